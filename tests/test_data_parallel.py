"""Data parallel (core_client.py's MPClient, config.py's data_parallel_* fields): one API server,
one engine core process per DP rank, each with its own scheduler, KV cache and TP workers. The
oracle is the offline single-engine `LLM` over the same tiny checkpoint: whichever rank serves a
greedy request, its tokens must be the same. Also: the balancing rule, the process tree
(1 + DP + DP x TP), a rank killed mid-stream, SIGTERM / SIGKILL of the server leaving no
process, and a --headless host on loopback.

    python -m pytest -q tests/test_data_parallel.py
"""

import asyncio
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from nanoserve import LLM, AsyncLLM, SamplingParams
from nanoserve.config import Config
from nanoserve.core_client import MPClient
from nanoserve.distributed import free_port, place_data_parallel_rank
from nanoserve.request import EngineCoreOutput, EngineCoreOutputs
from test_api import CONFIG, _alive, _descendants, serve

pytestmark = pytest.mark.skipif(not Path("/proc/self/task").is_dir(),
                                reason="reads the process tree in /proc")
FLAGS = ["--device", "cpu", "--num-kv-blocks", "64", "--max-model-len", "256"]
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def oracle(tmp_path_factory):
    """A tiny checkpoint, 16 prompts, and the offline single engine's greedy tokens for each."""
    from conftest import build_checkpoint
    path = tmp_path_factory.mktemp("dp_llama")
    build_checkpoint(path, "llama")
    prompts = [[(7 * i + 13 * j) % 380 + 1 for j in range(5 + i % 7)] for i in range(16)]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = LLM(str(path), **CONFIG).generate([{"prompt_token_ids": p} for p in prompts], params,
                                             progress=False)
    return SimpleNamespace(path=str(path), prompts=prompts, texts=[o.outputs[0].text for o in outs])


async def _complete(client: httpx.AsyncClient, prompt: list[int]) -> str:
    body = {"model": "m", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0,
            "ignore_eos": True}
    r = await client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def concurrent_greedy(url: str, prompts: list[list[int]]) -> list[str]:
    async def main():
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            return await asyncio.gather(*(_complete(client, p) for p in prompts))
    return asyncio.run(main())


def engine_series(url: str, name: str) -> dict[str, float]:
    """{engine label: value} of one engine series of /metrics."""
    text = httpx.get(url + "/metrics").text
    return {s.labels["engine"]: s.value for family in text_string_to_metric_families(text)
            for s in family.samples if s.name == f"nanoserve:{name}"}


def test_flags_config_checks_and_offline_error():
    from nanoserve.cli import build_parser
    args = build_parser().parse_args(["serve", "--data-parallel-size", "4",
                                      "--data-parallel-size-local", "2",
                                      "--data-parallel-address", "10.0.0.1",
                                      "--data-parallel-rpc-port", "13345"])
    config = Config.from_cli_args(args)
    assert (config.data_parallel_size, config.data_parallel_address,
            config.data_parallel_rpc_port) == (4, "10.0.0.1", 13345)
    assert list(config.data_parallel_ranks_here) == [0, 1] and not config.headless
    headless = lambda *flags: list(Config.from_cli_args(build_parser().parse_args(
        ["serve", "--headless", "--data-parallel-size", "4", *flags])).data_parallel_ranks_here)
    assert headless("--data-parallel-rank", "1") == [1]                # vLLM's -dpr: one rank
    assert headless("--data-parallel-start-rank", "2") == [2, 3]       # the rest from 2 on
    assert headless("--data-parallel-size-local", "4") == [0, 1, 2, 3]   # an API-only head
    for bad, field in [(dict(data_parallel_size=0), "data_parallel_size"),
                       (dict(data_parallel_size=2, data_parallel_rank=1), "data_parallel_rank"),
                       (dict(data_parallel_size=4, headless=True, data_parallel_rank=1,
                             data_parallel_size_local=2), "data_parallel_rank"),
                       (dict(headless=True, data_parallel_size_local=0), "data_parallel_size_local"),
                       (dict(data_parallel_size=2, data_parallel_size_local=3),
                        "data_parallel_size_local"),
                       (dict(data_parallel_size=2, engine_process=False), "data_parallel_size")]:
        with pytest.raises(ValueError, match=field):
            Config(**bad)
    with pytest.raises(ValueError, match="nanoserve serve --data-parallel-size"):
        LLM(data_parallel_size=2)


def test_memory_says_what_each_rank_holds():
    from rich.console import Console

    from nanoserve.tools.memory import memory_report, print_report
    one = memory_report(device_memory_gb=24, tensor_parallel_size=2)
    two = memory_report(device_memory_gb=24, tensor_parallel_size=2, data_parallel_size=2)
    assert (two.num_blocks, two.weight_bytes) == (one.num_blocks, one.weight_bytes)   # per rank
    console = Console(record=True, width=300)
    print_report(two, console)
    text = console.export_text()
    assert "per rank (DP 2)" in text and "4 GPUs" in text, text
    assert f"{2 * two.num_blocks * two.block_size:,} tokens" in text, text


def test_a_rank_gets_its_gpus_and_its_share_of_the_cores(monkeypatch):
    import torch
    threads = torch.get_num_threads()
    try:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
        place_data_parallel_rank(1, 2, 2)              # DP rank 1 of 2, TP 2: GPUs 2 and 3
        assert os.environ["CUDA_VISIBLE_DEVICES"] == "2,3"
        assert torch.get_num_threads() == max(1, (os.cpu_count() or 1) // 2)
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
        place_data_parallel_rank(1, 2, 2)              # of the GPUs the user made visible
        assert os.environ["CUDA_VISIBLE_DEVICES"] == "6,7"
    finally:
        torch.set_num_threads(threads)


def test_balancing_fewest_unfinished_waiting_weighs_more_aborts_follow():
    """The rule alone, on a client with three ranks and no processes."""
    client = object.__new__(MPClient)
    client.num_engines, client._rank_of = 3, {}
    client._unfinished, client._running = [0, 0, 0], [0, 0, 0]
    sent = []
    client._send = lambda rank, kind, payload: sent.append(
        (rank, kind, [getattr(p, "request_id", p) for p in payload]))
    add = lambda *ids: client.send("add", [SimpleNamespace(request_id=i) for i in ids])
    add("a")                  # all idle: the lowest rank
    add("0_b", "1_b")         # n = 2: both children on one rank, the next least loaded
    add("c")
    assert [s[0] for s in sent] == [0, 1, 2] and sent[1][2] == ["0_b", "1_b"]
    # Rank 0 reports "a" running: 1 running (1) < 1 waiting (4) < 2 waiting (8).
    client._track(0, EngineCoreOutputs(stats={"num_requests_running": 1}))
    add("d")
    assert sent[-1][0] == 0
    sent.clear()
    client.send("abort", ["1_b", "a", "0_b", "gone"])   # each to its rank; unknown ids nowhere
    assert sorted(sent) == [(0, "abort", ["a"]), (1, "abort", ["1_b", "0_b"])]
    client._track(1, EngineCoreOutputs([EngineCoreOutput(i, [], "abort") for i in ("0_b", "1_b")]))
    assert client._unfinished == [2, 0, 1] and "0_b" not in client._rank_of
    add("e")
    assert sent[-1][0] == 1


def test_a_silent_remote_rank_is_dead():
    """A rank on a --headless host has no sentinel here: silence past engine_iteration_timeout_s
    is death."""
    client = object.__new__(MPClient)
    client.num_engines, client._procs, client._dead_since = 2, {0: None}, None
    client.config = Config(engine_iteration_timeout_s=30.0)
    client._exited = SimpleNamespace(done=lambda: False)
    client._last_heard = [time.monotonic(), time.monotonic() - 15.0]
    assert client._dead_rank() is None
    client._last_heard[1] -= 30.0
    assert client._dead_rank() == 1 and client._dead_since is not None
    assert "rank 1 (on a --headless host)" in client._why_dead(1)


def test_dp2_two_engine_cores_greedy_equals_offline_and_both_serve(oracle):
    engine = AsyncLLM(oracle.path, data_parallel_size=2, **CONFIG)
    try:
        roles = dict(engine.engine_core.processes)
        assert roles.keys() == {"api server", "engine core 0", "engine core 1"}
        assert {roles["engine core 0"], roles["engine core 1"]} <= _descendants(os.getpid())
        with serve(engine, "m") as url:
            assert concurrent_greedy(url, oracle.prompts) == oracle.texts
            served = engine_series(url, "prefix_cache_queries_total")   # prompt tokens looked up
            assert served.keys() == {"0", "1"} and all(v > 0 for v in served.values()), served
            assert engine_series(url, "num_requests_running") == {"0": 0, "1": 0}
    finally:
        asyncio.run(engine.shutdown())


@contextlib.contextmanager
def serve_process(*args: str):
    """`nanoserve serve ARGS` on a free port; yields (process, {role: pid}, base URL) once it
    serves, having logged its process tree."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "nanoserve.cli", "serve", *args, *FLAGS,
                             "--port", str(port), "--served-model-name", "m"], stderr=subprocess.PIPE, text=True)
    try:
        roles = {}
        for line in proc.stderr:
            if m := re.match(r"nanoserve serve: (.+): pid (\d+)", line):
                roles[m.group(1)] = int(m.group(2))
            if "Application startup complete" in line:
                break
        yield proc, roles, f"http://127.0.0.1:{port}"
    finally:
        proc.kill()
        proc.wait()


def wait_all_gone(pids, seconds: float = 15.0) -> None:
    deadline = time.monotonic() + seconds
    while any(_alive(p) for p in pids):
        assert time.monotonic() < deadline, [p for p in pids if _alive(p)]
        time.sleep(0.1)


def test_dp2_tp2_seven_processes_a_dead_rank_fails_its_streams_and_sigterm_stops_all(oracle):
    with serve_process(oracle.path, "--data-parallel-size", "2", "--tensor-parallel-size", "2",
                       "--keep-alive-on-engine-death") as (proc, roles, url):   # to see the 503
        assert len(roles) == 1 + 2 + 2 * 2, roles          # API + DP + DP x TP
        assert {f"engine core {d} worker rank {r}" for d in (0, 1) for r in (0, 1)} < roles.keys()
        tree = _descendants(proc.pid)
        assert set(roles.values()) - {proc.pid} <= tree
        assert concurrent_greedy(url, oracle.prompts[:4]) == oracle.texts[:4]
        body = {"model": "m", "prompt": [5, 6, 7], "max_tokens": 240, "stream": True,
                "ignore_eos": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as first, \
                httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as second:
            lines = [(line for line in r.iter_lines() if line) for r in (first, second)]
            assert all("error" not in next(stream) for stream in lines)   # both are running
            os.kill(roles["engine core 1"], signal.SIGKILL)   # the second went to rank 1
            rest = list(lines[1])
        errors = [json.loads(line[len("data: "):])["error"] for line in rest if '"error"' in line]
        assert errors and "data-parallel rank 1" in errors[0]["message"], rest[-3:]
        assert rest[-1] == "data: [DONE]"
        health = httpx.get(url + "/health")
        assert health.status_code == 503 and "rank 1" in health.json()["error"]["message"]
        r = httpx.post(url + "/v1/completions", json={"model": "m", "prompt": [1, 2]})
        assert r.status_code == 503, r.text
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) in (0, -signal.SIGTERM)
        wait_all_gone(tree)


def test_headless_host_on_loopback_serves_and_sigkill_of_the_server_stops_both(oracle, monkeypatch):
    port = str(free_port())
    remote = ["--data-parallel-size", "2", "--data-parallel-address", "127.0.0.1",
              "--data-parallel-rpc-port", port]
    monkeypatch.setenv("NANOSERVE_RPC_SECRET", "the rpc secret of both hosts, 32+")
    headless = subprocess.Popen([sys.executable, "-m", "nanoserve.cli", "serve", oracle.path,
                                 "--headless", "--data-parallel-rank", "1", *remote, *FLAGS],
                                stderr=subprocess.DEVNULL)
    try:
        with serve_process(oracle.path, "--data-parallel-size-local", "1", *remote) as (
                proc, roles, url):
            assert {"api server", "engine core 0", "engine core 1 (--headless host)"} == roles.keys()
            tree = _descendants(proc.pid) | _descendants(headless.pid)
            assert roles["engine core 1 (--headless host)"] in tree
            prompts = oracle.prompts[:6]
            assert concurrent_greedy(url, prompts) == oracle.texts[:6]
            served = engine_series(url, "prefix_cache_queries_total")
            assert served.keys() == {"0", "1"} and all(v > 0 for v in served.values()), served
            proc.kill()               # no shutdown at all: both hosts' engine cores must notice
            proc.wait()
            assert headless.wait(15) is not None
            wait_all_gone(tree)
    finally:
        headless.kill()
        headless.wait()
