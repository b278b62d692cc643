"""roofline.py: the least time the bench workload could take on this machine, step by step, and
how far a real run is from it.

    python scripts/roofline.py                       # float32
    python scripts/roofline.py --dtype bfloat16

`nanoserve bench` compares the model's useful FLOP/s with the machine's matmul peak. A decode
step of a small model is not all matmul, though: it also reads every weight and each request's
whole K/V from memory. This script runs the bench workload once with a trace (nanoserve.trace)
to learn what each step held; then, as `nanoserve bench` does, it times the workload on a fresh
engine without a trace and measures the GEMM peak there (bench.matmul_peak), then the memory's
read bandwidth. It bounds each step from below by

    linears    max(2 x weights x tokens / peak,  weight bytes / bandwidth)
    LM head    max(2 x hidden x vocab x sampling rows / peak,  its weight bytes / bandwidth)
    attention  max(QK^T + PV FLOPs / peak,  bytes of the K/V cached before the step / bandwidth)

Everything else (norms, RoPE, the activation, sampling, Python) counts as free, so the sum is a
true lower bound. The ratio of useful FLOP/s at the bound to the peak is the highest "fraction of
peak" that `nanoserve bench` could print here. (On a shared machine the peak and the bandwidth
move between runs; both are measured right after the timed run, as bench measures its peak.)

Worked example, one decode step of 64 requests with 300 cached tokens each, bench model, bf16,
peak 430 GFLOP/s, 30 GB/s: linears max(2 x 106M x 64 / 430e9, 212 MB / 30e9) = max(31.6, 7.1)
ms; K/V 64 x 300 x 30 layers x 768 B = 442 MB -> 14.7 ms; so ~46 ms plus the LM head.
"""

import argparse
import json
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

from nanoserve.tools import bench
from nanoserve.models import get_head_size


def read_bandwidth(gib: float = 1.0) -> float:
    """Bytes/s of a float32 sum over a buffer far larger than any cache, best of 5 (all threads)."""
    buffer = torch.ones(int(gib * 2**30) // 4)
    buffer.sum()
    seconds = []
    for _ in range(5):
        start = time.perf_counter()
        buffer.sum()
        seconds.append(time.perf_counter() - start)
    return buffer.numel() * 4 / min(seconds)


def traced_steps(lines: list[str]) -> list[list[tuple[int, int, bool]]]:
    """Each step's requests as (tokens scheduled, cached tokens after the step, samples?), from
    a trace's lines. A request samples when its cache has caught up with all its tokens (the
    prompt and the outputs so far); the new token is then one more to feed."""
    tokens, cached, steps = {}, defaultdict(int), []
    for line in lines:
        event = json.loads(line)
        if event["ev"] == "arrive":
            tokens[event["req"]] = event["prompt_len"]
        elif event["ev"] == "preempt":
            cached[event["req"]] = 0   # recomputed from scratch (without prefix caching)
        elif event["ev"] == "schedule" and event["scheduled"]:
            step = []
            for req, n in event["scheduled"].items():
                cached[req] += n
                samples = cached[req] == tokens[req]
                tokens[req] += samples
                step.append((n, cached[req], samples))
            steps.append(step)
    return steps


def lower_bound(steps, hf_config, dtype: torch.dtype, peak: float, bandwidth: float) -> dict:
    """Seconds per part (see the module docstring), summed over the steps."""
    c, size = hf_config, dtype.itemsize
    h, layers, heads, kv_heads = c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads
    head_dim, weights = get_head_size(c), layers * bench.layer_weights(c)
    parts = dict.fromkeys(("linears", "LM head", "attention"), 0.0)
    for step in steps:
        tokens = sum(n for n, _, _ in step)
        rows = sum(samples for _, _, samples in step)
        parts["linears"] += max(2 * weights * tokens / peak, weights * size / bandwidth)
        if rows:   # a step of unfinished prompt chunks only samples nothing
            parts["LM head"] += max(2 * h * c.vocab_size * rows / peak, h * c.vocab_size * size / bandwidth)
        # Query i of a chunk of n ending at `seq` attends to seq - n + i + 1 positions.
        flops = sum(4 * layers * heads * head_dim * (n * (seq - n) + n * (n + 1) / 2) for n, seq, _ in step)
        # The K/V cached before this step must come from memory (the step's own may still be in cache).
        kv_bytes = sum(2 * layers * kv_heads * head_dim * size * (seq - n) for n, seq, _ in step)
        parts["attention"] += max(flops / peak, kv_bytes / bandwidth)
    return parts


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--num-prompts", type=int, default=64)
    args = parser.parse_args()
    print(f"machine: {bench.cpu_description()}")
    prompts, output_lens = bench.make_workload(args.num_prompts)
    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp) / "run.jsonl"
        # No prefix caching: then a request's cache holds exactly the tokens scheduled for it.
        llm = bench.make_bench_llm(None, args.dtype, trace=str(trace), enable_prefix_caching=False)
        warm_up = len(trace.read_text().splitlines())   # the warm-up request's events come first
        bench.time_workload(llm, prompts, output_lens)
        steps = traced_steps(trace.read_text().splitlines()[warm_up:])
        del llm
    # The timed run as `nanoserve bench` does it: a fresh engine, then the peak on that engine.
    llm = bench.make_bench_llm(None, args.dtype)
    run = bench.time_workload(llm, prompts, output_lens)
    peak, path = bench.matmul_peak(llm.engine.executor)
    bandwidth = read_bandwidth()
    hf_config, dtype = llm.engine.executor.hf_config, llm.engine.executor.dtype
    parts = lower_bound(steps, hf_config, dtype, peak, bandwidth)
    bound = sum(parts.values())
    flops = bench.useful_flops(hf_config, prompts, output_lens)
    print(f"{args.dtype}, {len(steps)} steps; GEMM peak {peak / 1e9:.1f} GFLOP/s ({path}), "
          f"read bandwidth {bandwidth / 1e9:.1f} GB/s, useful work {flops / 1e12:.2f} TFLOP")
    for name, seconds in parts.items():
        print(f"  least time, {name:9s} {seconds:6.2f} s")
    print(f"  least time, total     {bound:6.2f} s: at most {flops / bound / peak:.2f} of the peak")
    print(f"measured: {run['elapsed_s']:.2f} s, {run['output_tok_s']:.1f} tok/s, "
          f"{run['model_flop_s'] / peak:.2f} of the peak, {run['elapsed_s'] / bound:.2f}x the least time")


if __name__ == "__main__":
    main()
