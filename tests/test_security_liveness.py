"""Liveness (issue 51, findings 9 to 11): a hung tensor-parallel worker is a dead engine, not a
frozen one; the TP rendezvous listens on loopback only; `nanoserve serve` exits when its
engine dies (unless --keep-alive-on-engine-death) and leaves no process, not even a zombie.

    python -m pytest -q tests/test_security_liveness.py
"""

import contextlib
import json
import os
import re
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest

from conftest import build_checkpoint
from nanoserve import LLM, SamplingParams
from security_kit import MODEL, completion_body, live_server
from test_api import _alive, _descendants

pytestmark = pytest.mark.skipif(not Path("/proc/self/task").is_dir(),
                                reason="reads processes and sockets in /proc")

TIMEOUT_S = 5.0      # engine_iteration_timeout_s of the tests: a tiny model's step takes ms


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("liveness")
    build_checkpoint(path, "llama")
    return str(path)


def _start_time(pid: int):
    """The process's start time (/proc/<pid>/stat field 22): a pid reused by another process
    has another one. None once it is gone."""
    with contextlib.suppress(FileNotFoundError):
        return Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1].split()[19]
    return None


@contextlib.contextmanager
def stopped(pid: int):
    """SIGSTOP `pid` for the block; afterwards nothing of it is left (SIGCONT, then SIGKILL if
    the engine has not killed it already)."""
    started = _start_time(pid)
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        if _start_time(pid) == started:
            os.kill(pid, signal.SIGCONT)
            os.kill(pid, signal.SIGKILL)


def test_a_stopped_tp_worker_is_a_dead_engine_not_a_frozen_stream(tmp_path):
    """Finding 9, TP workers: SIGSTOP worker rank 1 mid-stream. Its peer waits for it inside a
    collective, so the step never ends; after engine_iteration_timeout_s the executor calls it
    a WorkerError: the stream ends with an error, /health turns 503, the workers are gone."""
    with live_server(tmp_path, tensor_parallel_size=2, engine_iteration_timeout_s=TIMEOUT_S,
                     max_model_len=512) as server:
        pids = dict(server.engine.engine_core.processes)
        worker = pids["engine core 0 worker rank 1"]
        body = completion_body(max_tokens=400)
        with httpx.stream("POST", server.url + "/v1/completions", json=body,
                          timeout=10 * TIMEOUT_S) as response:   # bounds a frozen stream
            events = (json.loads(line[6:]) for line in response.iter_lines()
                      if line.startswith("data: ") and line != "data: [DONE]")
            assert "error" not in next(events)
            with stopped(worker):
                rest = list(events)
                assert rest and "error" in rest[-1], rest[-1:]
                assert server.client.get("/health").status_code == 503
                deadline = time.monotonic() + 30
                while _alive(pids["engine core 0 worker rank 0"]) or _alive(worker):
                    assert time.monotonic() < deadline, "the workers outlived a dead engine"
                    time.sleep(0.1)


def test_a_stopped_tp_worker_is_a_worker_error_in_the_executor(checkpoint):
    """The same in the executor itself (no API server's watchdog in the way), the worker stopped
    between steps, the next one too big for a pipe's buffer (200 prompts: some 400 kB pickled,
    which a send to a worker that does not read would wait on forever): the step waits
    engine_iteration_timeout_s at most, then the engine is dead, saying why."""
    llm = LLM(checkpoint, block_size=16, num_kv_blocks=4096, max_model_len=512, max_num_seqs=256,
              max_num_batched_tokens=65536, tensor_parallel_size=2,
              engine_iteration_timeout_s=TIMEOUT_S)
    worker = llm.engine.executor.procs[1]
    prompts = [{"prompt_token_ids": [i % 300 + 1] * 400} for i in range(200)]
    result = {}

    def generate():
        try:
            llm.generate(prompts, SamplingParams(max_tokens=2), progress=False)
        except Exception as e:      # noqa: BLE001 (the test looks at it)
            result["error"] = e
    thread = threading.Thread(target=generate, daemon=True)
    with stopped(worker.pid):
        thread.start()
        thread.join(10 * TIMEOUT_S)
        assert not thread.is_alive(), "the step waits for the stopped worker forever"
    assert "hung or stopped" in str(result.get("error")), result
    assert not any(p.is_alive() for p in llm.engine.executor.procs)


def _listening(pid: int) -> list[str]:
    """The local addresses (hex, as /proc/net/tcp{,6} writes them) of the TCP sockets `pid`
    listens on."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):
            if (link := os.readlink(fd)).startswith("socket:["):
                inodes.add(link[len("socket:["):-1])
    found = []
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            cols = line.split()
            if cols[3] == "0A" and cols[9] in inodes:     # state 0A: LISTEN
                found.append(cols[1].split(":")[0])
    return found


LOOPBACK = ("0100007F",                                   # 127.0.0.1
            "00000000000000000000000001000000",           # ::1
            "0000000000000000FFFF00000100007F")           # ::ffff:127.0.0.1


def test_tp_rendezvous_listens_on_loopback_only(checkpoint):
    """Finding 10: while TP=2 workers run, none of their sockets listens on another address
    than loopback (torch's TCPStore listened on all of them); the rendezvous is a file in a
    directory only this user can enter, gone with the executor."""
    llm = LLM(checkpoint, block_size=16, num_kv_blocks=64, tensor_parallel_size=2)
    executor = llm.engine.executor
    addresses = [a for p in executor.procs for a in _listening(p.pid)]
    assert addresses, "no listening socket found: the test reads /proc wrong"
    assert all(a in LOOPBACK for a in addresses), addresses
    directory = Path(executor.rendezvous_dir)
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    executor.close()
    assert not directory.exists()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def nanoserve_serve(checkpoint, *flags):
    """`nanoserve serve` in a subprocess on a free loopback port, once it serves; yields proc,
    url, roles ({role: pid}, as it logs them), lines (its stderr) and drain (the thread reading
    them: it ends when no process holds the stderr pipe). Killed at the end whatever happened."""
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "nanoserve.cli", "serve", checkpoint,
                             "--port", str(port), "--served-model-name", MODEL, "--device", "cpu",
                             "--num-kv-blocks", "16", "--max-model-len", "256", *flags],
                            stderr=subprocess.PIPE, text=True)
    lines, up = [], threading.Event()

    def drain():      # read stderr to its end, so the server never blocks on a full pipe
        for line in proc.stderr:
            lines.append(line)
            if "Application startup complete" in line:
                up.set()
    drainer = threading.Thread(target=drain, daemon=True)
    drainer.start()
    try:
        assert up.wait(120), "".join(lines)
        roles = {m.group(1): int(m.group(2)) for line in lines
                 if (m := re.match(r"nanoserve serve: (.+): pid (\d+)", line))}
        yield SimpleNamespace(proc=proc, url=f"http://127.0.0.1:{port}", roles=roles,
                              lines=lines, drain=drainer)
    finally:
        proc.kill()
        proc.wait()


def test_serve_exits_when_its_engine_dies(checkpoint):
    """Finding 11: SIGKILL the engine core mid-stream: the stream gets its error, then the
    server exits with a non-zero status (vLLM's default too) and leaves no process behind."""
    with nanoserve_serve(checkpoint) as server:
        tree = _descendants(server.proc.pid)
        core = server.roles["engine core 0"]
        assert core in tree
        body = completion_body(max_tokens=200)
        with httpx.stream("POST", server.url + "/v1/completions", json=body,
                          timeout=30) as response:
            stream = (line for line in response.iter_lines() if line.startswith("data: "))
            assert "error" not in next(stream)
            os.kill(core, signal.SIGKILL)
            rest = list(stream)
        assert any('"error"' in line for line in rest) and rest[-1] == "data: [DONE]", rest[-2:]
        try:
            status = server.proc.wait(30)
        except subprocess.TimeoutExpired:
            pytest.fail("the server outlived its engine")
        server.drain.join(30)           # EOF: no process of the tree holds its stderr any more
        assert not server.drain.is_alive() and status == 1, "".join(server.lines[-20:])
        assert "exiting, the engine is dead" in server.lines[-1]
        assert not any(_alive(p) for p in tree)    # (once the server is gone, init reaps)
        assert not Path(f"/proc/{core}").exists()   # the server reaped its own child


def test_serve_keeps_alive_on_engine_death_with_the_flag(checkpoint):
    """--keep-alive-on-engine-death: the server stays up answering /health 503 (why), even when
    the engine core dies while no request is open, and the dead child is reaped (no zombie)."""
    with nanoserve_serve(checkpoint, "--keep-alive-on-engine-death") as server:
        core = server.roles["engine core 0"]
        os.kill(core, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while (health := httpx.get(server.url + "/health")).status_code != 503:
            assert time.monotonic() < deadline, "an idle engine's death went unseen"
            time.sleep(0.2)
        assert str(core) in health.json()["error"]["message"]
        while Path(f"/proc/{core}").exists():     # a zombie too has its /proc entry
            assert time.monotonic() < deadline, "the dead engine core is left a zombie"
            time.sleep(0.1)
        time.sleep(1.0)
        assert server.proc.poll() is None
        assert httpx.get(server.url + "/health").status_code == 503
