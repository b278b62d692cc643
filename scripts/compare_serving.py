"""compare_serving.py: nanoserve's HTTP server and vLLM's OpenAI server under the same two loads,
one after the other on this machine, in one table.

    python scripts/compare_serving.py                                   # nanoserve alone
    python scripts/compare_serving.py --vllm-python ~/vllm-venv/bin/python --plot-dir figures
    python scripts/compare_serving.py --layout DP=1: --layout "DP=2:--data-parallel-size 2" \
        --layout "TP=2:--tensor-parallel-size 2"          # nanoserve's process layouts, in turn

Each server gets the same checkpoint (default: random SmolLM2-135M-shaped weights with a
word-level tokenizer, nanoserve.tools.bench.make_checkpoint()), bfloat16, 4 GiB of KV cache and
max_model_len 1024, on a free loopback port. The script waits for /health, runs the loads with
the `nanoserve bench --serve` client (bench_serve.py; one short warm-up request before each),
then stops the server (its whole process group: vLLM runs its engine in a child process) before
the next one starts; a server is stopped on Ctrl-C, SIGTERM or an error too.

The loads: 48 requests arriving as a Poisson process at 2 req/s, then 64 requests at once;
prompts of 32-512 token ids, max_tokens 32-256, ignore_eos, temperature 0. Both servers get the
same prompts and arrival times (same seeds). vLLM runs as in compare_vllm.py (every core, the
same KV cache size); see that script for its virtualenv. Benchmark on an idle machine.
"""

import argparse
import asyncio
import contextlib
import json
import math
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from rich.console import Console
from rich.table import Table

from compare_vllm import vllm_env
from nanoserve.tools import bench_serve
from nanoserve.tools.bench import cpu_description, make_checkpoint
from nanoserve.distributed import free_port

LOADS = {"poisson-2": (48, 2.0), "burst": (64, math.inf)}   # name: (requests, req/s)
INPUT_LEN, OUTPUT_LEN = (32, 512), (32, 256)


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM to the server's process group, SIGKILL after 30 s, then to any child left."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            pass
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


@contextlib.contextmanager
def running(name: str, cmd: list[str], env: dict, port: int, log_dir: str, timeout: float):
    """Start a server (in its own session, so that stop() reaches all its processes), wait for
    /health, yield (its base URL, its pid); stop it however the block ends."""
    log_path = os.path.join(log_dir, f"{name}.log")
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + timeout
        while not _healthy(url):
            if proc.poll() is not None or time.monotonic() > deadline:
                tail = Path(log_path).read_text()[-3000:]
                raise SystemExit(f"{name} did not come up (exit code {proc.poll()}):\n{tail}")
            time.sleep(1)
        yield url, proc.pid
    finally:
        stop(proc)


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def run_loads(url: str, server: str, sizes: dict) -> dict:
    """Every load against the server at `url`: {load: (results, metrics)}."""
    model, runs = bench_serve.served_model(url), {}
    for i, (load, (_, rate)) in enumerate(LOADS.items()):
        prompts, output_lens = bench_serve.make_requests(sizes[load], INPUT_LEN, OUTPUT_LEN, seed=i)
        results, duration = asyncio.run(bench_serve.run(url, model, prompts, output_lens, rate, i))
        runs[load] = (results, bench_serve.compute_metrics(results, duration))
        bench_serve.print_report(runs[load][1], f"{server}: {load}, {sizes[load]} requests")
    return runs


def print_table(all_runs: dict, sizes: dict) -> None:
    table = Table(title="serving: output tokens/s and latency percentiles (ms)")
    for col in ("load", "server", "output tok/s", "TTFT p50 / p99", "ITL p50 / p99", "E2E p50",
                "failed"):
        table.add_column(col, justify="left" if col in ("load", "server") else "right")
    ms = lambda v: "-" if v is None else f"{v:,.0f}"
    for load, (_, rate) in LOADS.items():
        arrivals = "at once" if math.isinf(rate) else f"Poisson {rate:g} req/s"
        for server, runs in all_runs.items():
            m = runs[load][1]
            e2e = m["e2e_ms"]["p50"]
            first = server == next(iter(all_runs))
            table.add_row(f"{sizes[load]} requests, {arrivals}" if first else "",
                          server, f"{m['output_throughput']:.1f}",
                          f"{ms(m['ttft_ms']['p50'])} / {ms(m['ttft_ms']['p99'])}",
                          f"{ms(m['itl_ms']['p50'])} / {ms(m['itl_ms']['p99'])}",
                          "-" if e2e is None else f"{e2e / 1e3:.1f} s", str(m["failed"]))
    console = Console(width=None if sys.stdout.isatty() else 120)   # a log keeps whole rows
    console.print(table)
    console.print(f"machine: {cpu_description()}", soft_wrap=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", help="HF checkpoint directory (default: the random "
                        "SmolLM2-135M-shaped one of nanoserve.tools.bench.make_checkpoint())")
    parser.add_argument("--vllm-python", help="python of a vLLM virtualenv: compare with vLLM")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--kv-cache-memory-gb", type=float, default=4.0)
    parser.add_argument("--num-prompts", type=int, nargs=2, default=[n for n, _ in LOADS.values()],
                        metavar=("POISSON", "BURST"), help="requests in each load (a quick "
                        "check: smaller)")
    parser.add_argument("--plot-dir", help="write each load's latency CDFs, both servers on one "
                        "figure, to DIR/serving-<load>.png")
    parser.add_argument("--save-result", metavar="FILE", help="write every metric as JSON")
    parser.add_argument("--layout", action="append", metavar="NAME:FLAGS", help="a nanoserve "
                        "server named NAME, started with these extra `nanoserve serve` flags, e.g. "
                        "'DP=2:--data-parallel-size 2'; repeat to compare layouts (default: one, "
                        "'nanoserve', with none)")
    parser.add_argument("--startup-timeout", type=float, default=900, help="seconds to wait for "
                        "a server's /health")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))   # run the finally blocks: stop servers
    ckpt, sizes = args.checkpoint or str(make_checkpoint()), dict(zip(LOADS, args.num_prompts))
    common = ["--dtype", args.dtype, "--max-model-len", "1024"]
    port = free_port()
    servers = {name: ([sys.executable, "-m", "nanoserve.cli", "serve", ckpt, "--port", str(port),
                       "--kv-cache-memory-gb", f"{args.kv_cache_memory_gb:g}", *common,
                       *shlex.split(flags)], dict(os.environ))
               for name, flags in (layout.split(":", 1) for layout in args.layout or ["nanoserve:"])}
    if args.vllm_python:
        servers["vLLM CPU"] = ([args.vllm_python, "-m", "vllm.entrypoints.openai.api_server",
                                "--model", ckpt, "--host", "127.0.0.1", "--port", str(port),
                                "--seed", "0", *common], vllm_env(args.kv_cache_memory_gb))
    all_runs = {}
    with tempfile.TemporaryDirectory() as logs:
        for name, (cmd, env) in servers.items():
            with running(name.split()[0], cmd, env, port, logs, args.startup_timeout) as (url, _):
                all_runs[name] = run_loads(url, name, sizes)
    print_table(all_runs, sizes)
    if args.plot_dir:
        os.makedirs(args.plot_dir, exist_ok=True)
        for load in LOADS:
            bench_serve.plot_runs({name: runs[load] for name, runs in all_runs.items()},
                                  os.path.join(args.plot_dir, f"serving-{load}.png"))
    if args.save_result:
        with open(args.save_result, "w") as f:
            json.dump({name: {load: metrics for load, (_, metrics) in runs.items()}
                       for name, runs in all_runs.items()}, f, indent=1)


if __name__ == "__main__":
    main()
