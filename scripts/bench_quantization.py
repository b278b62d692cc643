"""bench_quantization.py: decode tok/s of bf16 against --quantization int8 (and fp8), in one
process, the engines taking turns, beside the roofline (weight bytes a step reads / this
machine's read bandwidth). Random SmolLM2-135M-shaped weights (nanoserve bench's checkpoint).

    python scripts/bench_quantization.py                     # batch 1 and 8, 5 rounds each
    python scripts/bench_quantization.py --batch 1 8 64 --rounds 7 --output-len 128 --fp8

A decode step at batch 1 reads every weight once, so its bound is bandwidth / bytes per step;
with the LM head left in bf16, int8 reads ~60% of bf16's bytes (bound ~1.65x). The 64-request
workload is `nanoserve bench --dtype bfloat16 [--quantization int8]` (its own table).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from nanoserve import LLM, SamplingParams
from nanoserve.layers import Linear
from nanoserve.tools.bench import cpu_description, make_checkpoint


def read_bandwidth(gib: float = 1.0, repeats: int = 5) -> float:
    """Bytes/s of a sum over a tensor far larger than any cache: what streaming weights can reach."""
    x = torch.ones(int(gib * 2**30) // 2, dtype=torch.bfloat16)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - start)
    return x.numel() * 2 / best


def weight_bytes(llm: LLM) -> int:
    """Bytes one decode step reads: every layer's product weight as its path holds it (the CPU
    backend's Gemm, scales included; else the Linear's own tensors), and the LM head, kept in the
    model dtype: the embedding's shape."""
    model = llm.engine.executor.model_runner.model
    linears = [m for layer in model.model.layers for m in layer.modules() if isinstance(m, Linear)]
    held = [getattr(m.impl, "__self__", m) for m in linears]   # a Gemm's bound product, or the Linear
    own = lambda linear: sum(t.nbytes for t in [*linear.parameters(), *linear.buffers()])  # noqa: E731
    return sum(own(h) if isinstance(h, Linear) else h.nbytes for h in held) + model.model.embed_tokens.weight.nbytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--fp8", action="store_true", help="Also fp8 (widened to bf16 on CPU).")
    args = parser.parse_args()
    path = str(make_checkpoint())
    methods = [None, "int8"] + (["fp8"] if args.fp8 else [])
    llms = {q: LLM(path, dtype="bfloat16", quantization=q, max_model_len=1024, kv_cache_memory_gb=1.0)
            for q in methods}
    bandwidth = read_bandwidth()
    print(cpu_description(), f"| {torch.get_num_threads()} threads | read bandwidth {bandwidth / 1e9:.1f} GB/s")
    for q, llm in llms.items():
        print(f"{q or 'bfloat16'}: {weight_bytes(llm) / 1e6:.1f} MB a step, roofline "
              f"{bandwidth / weight_bytes(llm):.1f} steps/s; "
              f"paths {llm.engine.executor.gemm_paths}")
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    for batch in args.batch:
        prompts = [{"prompt_token_ids": list(range(10 + i, 26 + i))} for i in range(batch)]
        rates = {q: [] for q in llms}
        for _ in range(args.rounds):
            for q, llm in llms.items():   # taking turns: a burst of other load hits each alike
                start = time.perf_counter()
                llm.generate(prompts, params, progress=False)
                rates[q].append(batch * args.output_len / (time.perf_counter() - start))
        median = {q: statistics.median(r) for q, r in rates.items()}
        print(f"batch {batch}: " + ", ".join(f"{q or 'bfloat16'} {m:.1f} tok/s ({m / median[None]:.2f}x)"
                                              for q, m in median.items()))


if __name__ == "__main__":
    main()
