"""bench_offline.py: the standard offline workload through nanoserve and through HF `generate`.

    python scripts/bench_offline.py                  # float32: both engines and their ratio
    python scripts/bench_offline.py --dtype bfloat16

The workload and model are nanoserve.tools.bench's (64 requests, prompts uniform in [32, 512],
outputs uniform in [32, 256], random token ids with seed 0, greedy, ignore_eos, random
SmolLM2-135M-shaped weights). HF runs the same requests in padded batches of 16 (left
padding); only each request's own output length is counted, so both figures are
"requested output tokens per second", measured in the same process.
"""

import argparse
import time

import torch

from nanoserve.tools.bench import make_checkpoint, make_workload, run_bench


@torch.inference_mode()
def run_hf(path, prompts, output_lens, dtype, batch_size=16):
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).eval()
    model.generation_config.eos_token_id = None
    start = time.perf_counter()
    for i in range(0, len(prompts), batch_size):
        batch, lens = prompts[i:i + batch_size], output_lens[i:i + batch_size]
        width = max(map(len, batch))
        ids = torch.tensor([[0] * (width - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        model.generate(ids, attention_mask=mask, max_new_tokens=max(lens),
                       min_new_tokens=max(lens), do_sample=False, pad_token_id=0)
    return sum(output_lens) / (time.perf_counter() - start)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = parser.parse_args()
    path = make_checkpoint()
    ours = run_bench(str(path), args.num_prompts, dtype=args.dtype)
    print(f"{ours['requests']} requests, {ours['prompt_tokens']} prompt tokens, "
          f"{ours['output_tokens']} output tokens, {args.dtype}, {ours['threads']} threads")
    print(f"nanoserve:                   {ours['output_tok_s']:8.1f} output tok/s")
    prompts, output_lens = make_workload(args.num_prompts)
    hf = run_hf(path, prompts, output_lens, args.dtype)
    print(f"HF generate (batches of 16): {hf:8.1f} output tok/s")
    print(f"ratio nanoserve / HF: {ours['output_tok_s'] / hf:.2f}x")


if __name__ == "__main__":
    main()
