"""bench_offline.py: the standard offline workload, through nanoserve and through HF `generate`.

    python scripts/bench_offline.py                  # float32, both engines, ratio printed
    python scripts/bench_offline.py --dtype bfloat16 --skip-hf

Model: random weights with SmolLM2-135M's shape (hidden 576, 30 layers, 9 heads, 3 KV heads,
intermediate 1536, vocab 49152, tied embeddings), written once with save_pretrained to
--model-dir and loaded by the real loader. Requests: 64, prompt lengths uniform in [32, 512],
output lengths uniform in [32, 256], random token ids (seed 0), greedy, ignore_eos.
HF runs the same requests in padded batches of 16 (left padding), and only each request's
own output length is counted, so both figures are "requested tokens per second".
"""

import argparse
import random
import time
from pathlib import Path

import torch

SMOLLM2_135M = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                    num_attention_heads=9, num_key_value_heads=3, vocab_size=49152,
                    max_position_embeddings=2048, rms_norm_eps=1e-5, tie_word_embeddings=True,
                    architectures=["LlamaForCausalLM"])


def make_checkpoint(path: Path) -> Path:
    """Random SmolLM2-135M-shaped weights plus a small tokenizer, saved once."""
    if (path / "model.safetensors").is_file():
        return path
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
    from tokenizers import Tokenizer, models, pre_tokenizers
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**SMOLLM2_135M)).save_pretrained(path)
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(SMOLLM2_135M["vocab_size"])},
                                     unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="t0").save_pretrained(path)
    return path


def make_workload(num_prompts, input_range, output_range, vocab_size, seed=0):
    rng = random.Random(seed)
    prompts = [[rng.randrange(vocab_size) for _ in range(rng.randint(*input_range))]
               for _ in range(num_prompts)]
    return prompts, [rng.randint(*output_range) for _ in range(num_prompts)]


def run_nanoserve(path, prompts, output_lens, dtype):
    from nanoserve import LLM, SamplingParams
    llm = LLM(str(path), dtype=dtype, kv_cache_memory_gb=4, max_num_seqs=64,
              max_num_batched_tokens=2048, max_model_len=1024)
    params = [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=n) for n in output_lens]
    llm.generate([{"prompt_token_ids": p} for p in prompts[:2]],
                 SamplingParams(temperature=0.0, max_tokens=4), progress=False)   # warm-up
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, progress=False)
    elapsed = time.perf_counter() - start
    assert [len(o.outputs[0].token_ids) for o in outs] == output_lens
    return sum(output_lens) / elapsed, elapsed


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
        model.generate(ids, attention_mask=mask, max_new_tokens=max(lens), min_new_tokens=max(lens),
                       do_sample=False, pad_token_id=0)
    elapsed = time.perf_counter() - start
    return sum(output_lens) / elapsed, elapsed


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, nargs=2, default=(32, 512))
    parser.add_argument("--output-len", type=int, nargs=2, default=(32, 256))
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--model-dir", type=Path, default=Path("/tmp/nanoserve-bench-smollm2-135m"))
    parser.add_argument("--skip-hf", action="store_true", help="Run nanoserve only.")
    args = parser.parse_args()
    path = make_checkpoint(args.model_dir)
    prompts, output_lens = make_workload(args.num_prompts, args.input_len, args.output_len,
                                         SMOLLM2_135M["vocab_size"])
    print(f"{len(prompts)} requests, {sum(map(len, prompts))} prompt tokens, "
          f"{sum(output_lens)} output tokens, {args.dtype}, {torch.get_num_threads()} threads")
    ours, t = run_nanoserve(path, prompts, output_lens, args.dtype)
    print(f"nanoserve: {ours:8.1f} output tok/s ({t:.1f} s)")
    if not args.skip_hf:
        hf, t = run_hf(path, prompts, output_lens, args.dtype)
        print(f"HF generate (batches of 16): {hf:8.1f} output tok/s ({t:.1f} s)")
        print(f"ratio nanoserve / HF: {ours / hf:.2f}x")


if __name__ == "__main__":
    main()
