"""compare_trees.py: the bench workload on nanoserve as two or more trees (or settings) build it,
side by side, taking turns: is a change faster or slower, and by how much?

    git worktree add /tmp/before HEAD~3
    python scripts/compare_trees.py --dtype bfloat16 --variant before=/tmp/before \
        --variant after=. --variant after-eager=.:ENFORCE_EAGER=1

A variant is NAME=TREE[:VAR=VALUE,...]: nanoserve imported from TREE (a checkout's root) with those
environment variables (ENFORCE_EAGER=1: the engine with --enforce-eager). Each variant's engine
runs in a process of its own (this Python, PYTHONPATH set to its tree), started and warmed up
once; then the workload (nanoserve.tools.bench's, the same one scripts/compare_vllm.py runs: 64
requests, prefix caching off) is timed `--runs` times in each,
the variants taking turns in an order that rotates every round, and the others stopped (SIGSTOP)
while one runs, as scripts/compare_vllm.py does with vLLM and for the same reasons (the host's
speed drifts within minutes; a waiting engine still uses some CPU). Prints each variant's median
and each one's ratio to the first, per round and of the medians, with the machine's lscpu line.
"""

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from compare_vllm import EngineProcess   # noqa: E402  (an engine in a subprocess, paused while others run)

from nanoserve.tools.bench import cpu_description, make_checkpoint, make_workload   # noqa: E402

NANOSERVE_SIDE = r"""
import json, os, sys, time
from nanoserve import LLM, SamplingParams

spec = json.load(open(sys.argv[1]))
eager = {"enforce_eager": True} if os.environ.get("ENFORCE_EAGER") == "1" else {}
llm = LLM(spec["model"], dtype=spec["dtype"], quantization=spec["quantization"], kv_cache_memory_gb=4,
          max_model_len=1024, enable_prefix_caching=False, **eager)
llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=4), progress=False)
print("READY", flush=True)
params = [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=n) for n in spec["output_lens"]]
for _ in sys.stdin:
    start = time.perf_counter()
    llm.generate([{"prompt_token_ids": p} for p in spec["prompts"]], params, progress=False)
    elapsed = time.perf_counter() - start
    print("RESULT", json.dumps({"output_tok_s": sum(spec["output_lens"]) / elapsed}), flush=True)
"""


def parse_variant(text: str) -> tuple[str, dict]:
    """'NAME=TREE:A=1,B=2' -> (NAME, the environment its engine runs with)."""
    name, _, rest = text.partition("=")
    tree, _, assignments = rest.partition(":")
    env = {**os.environ, "PYTHONPATH": str(Path(tree).resolve())}
    env.update(a.split("=", 1) for a in assignments.split(",") if a)
    return name, env


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variant", action="append", required=True, help="NAME=TREE[:VAR=VALUE,...]")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--quantization", choices=["int8", "fp8"], help="every variant's weights")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    prompts, output_lens = make_workload(args.num_prompts)
    spec = {"model": str(make_checkpoint()), "dtype": args.dtype, "quantization": args.quantization,
            "prompts": prompts, "output_lens": output_lens}
    variants = [parse_variant(v) for v in args.variant]
    results = {name: [] for name, _ in variants}
    with tempfile.TemporaryDirectory() as tmp:
        engines = {}
        try:
            for name, env in variants:
                os.makedirs(f"{tmp}/{name}")
                engines[name] = EngineProcess(sys.executable, spec, f"{tmp}/{name}", NANOSERVE_SIDE, env)
            for i in range(args.runs):
                order = [v[0] for v in variants[i % len(variants):] + variants[:i % len(variants)]]
                for name in order:
                    with contextlib.ExitStack() as others:
                        for other in (e for n, e in engines.items() if n != name):
                            others.enter_context(other.paused())
                        results[name].append(engines[name].run())
                print(f"round {i + 1}: " + ", ".join(f"{n} {results[n][-1]:.1f}" for n in results), flush=True)
        finally:
            for engine in engines.values():
                engine.close()
    first = variants[0][0]
    print(f"machine: {cpu_description()}")
    print(f"workload: {len(prompts)} requests, {sum(map(len, prompts))} prompt tokens, "
          f"{sum(output_lens)} output tokens, {args.dtype}, prefix caching off; variants took turns")
    for name, runs in results.items():
        ratios = [a / b for a, b in zip(runs, results[first])]
        print(f"{name:>16}: {statistics.median(runs):7.1f} output tok/s (runs: "
              f"{', '.join(f'{x:.1f}' for x in runs)}); / {first}: "
              f"{statistics.median(runs) / statistics.median(results[first]):.3f}x of the medians, "
              f"per round {', '.join(f'{r:.3f}' for r in ratios)}")


if __name__ == "__main__":
    main()
