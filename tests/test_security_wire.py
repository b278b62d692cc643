"""Red-team probes of seam 1's sockets (issue 51, findings 1 and 9): core_client.py, serial_utils.py.

A raw ZeroMQ client on the rpc port of a server with a --headless rank (loopback) sends what an
attacker would: a pickle that runs code when loaded, garbage, identities that are no rank's, a
forged message without the right MAC. A victim stream runs beside each (tests/security_kit.py):
its tokens must equal its run alone, and the server must stay healthy. Also: every message type
through the typed encoder/decoder and back, the rpc secret (required for remote ranks, refused
when wrong, never in a trace), and the watchdog (a SIGSTOPped engine core is dead in bounded time).

    python -m pytest -q tests/test_security_wire.py
"""

import dataclasses
import inspect
import json
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import httpx
import msgspec
import pytest
import zmq

from security_kit import (CONFIG, MODEL, assert_untouched, completion_body, live_server,
                          stream_text, victim)

SECRET = "the rpc secret of this test, 32+ chars"
FLAGS = ["--device", "cpu", "--num-kv-blocks", "64", "--max-model-len", "256"]


class Marker:
    """Unpickling this creates a file: the proof that a frame ran code in the server."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return open, (self.path, "w")


def free_port() -> int:
    from nanoserve.distributed import free_port
    return free_port()


@pytest.fixture(scope="module")
def dp_server(tmp_path_factory):
    """An API server (data_parallel_size 2, one rank here) and a --headless rank 1 on loopback;
    the secret comes from the environment, as the README's recipe sets it."""
    from conftest import build_checkpoint
    from test_api import serve

    from nanoserve import AsyncLLM
    path = tmp_path_factory.mktemp("wire")
    build_checkpoint(path, "llama")
    port = free_port()
    os.environ["NANOSERVE_RPC_SECRET"] = SECRET
    headless = subprocess.Popen(
        [sys.executable, "-m", "nanoserve.cli", "serve", str(path), "--headless",
         "--data-parallel-size", "2", "--data-parallel-rank", "1", "--data-parallel-rpc-port",
         str(port), *FLAGS], stderr=subprocess.DEVNULL)
    engine = None
    try:
        engine = AsyncLLM(str(path), **CONFIG, data_parallel_size=2, data_parallel_size_local=1,
                          data_parallel_rpc_port=port)
        with serve(engine, MODEL) as url, httpx.Client(base_url=url, timeout=120) as client:
            server = SimpleNamespace(url=url, engine=engine, client=client, path=str(path),
                                     port=port)
            server.expected = stream_text(server)
            yield server
    finally:
        del os.environ["NANOSERVE_RPC_SECRET"]
        if engine is not None:
            engine.engine_core.shutdown()
        headless.kill()
        headless.wait()


def send_raw(port: int, identity, *frames: bytes) -> None:
    """One message from a raw DEALER (the attacker), with the identity it chooses (the ROUTER
    refuses a second peer with an identity in use: each message of a test has its own)."""
    context = zmq.Context()
    sock = context.socket(zmq.DEALER)
    if identity is not None:
        sock.setsockopt(zmq.IDENTITY, identity)
    sock.connect(f"tcp://127.0.0.1:{port}")
    sock.send_multipart(list(frames))
    context.destroy(linger=2000)          # deliver it before closing


def num_dropped(server) -> int:
    codec = getattr(server.engine.engine_core, "_codec", None)
    return getattr(codec, "num_dropped_total", 0)


def attack(server, *messages) -> None:
    """Send each (identity, frames...) beside a victim stream; the victim is untouched, and the
    server dropped every message (it did not just miss them)."""
    before = num_dropped(server)
    with victim(server) as v:
        for identity, *frames in messages:
            send_raw(server.port, identity, *frames)
        deadline = time.monotonic() + 10
        while num_dropped(server) < before + len(messages) and time.monotonic() < deadline:
            time.sleep(0.05)
    assert_untouched(server, v)
    assert num_dropped(server) == before + len(messages)


def test_a_pickled_payload_never_runs(dp_server, tmp_path):
    """Today every frame is pickle.loads-ed: this one would create a file (or run a shell)."""
    marker = tmp_path / "pwned"
    payload = pickle.dumps(Marker(str(marker)))
    before = num_dropped(dp_server)
    with victim(dp_server) as v:
        send_raw(dp_server.port, b" 1", payload)      # int(b" 1") == 1: today's check passes it
        deadline = time.monotonic() + 10
        while num_dropped(dp_server) == before and not marker.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
    assert not marker.exists(), "a frame from the rpc port ran code in the API server"
    assert_untouched(dp_server, v)
    assert num_dropped(dp_server) == before + 1


def test_garbage_bytes_are_dropped(dp_server):
    attack(dp_server, (b"01", b"\x80\x05garbage, not a message"), (b"001", b""),
           (b"+01", os.urandom(200)))


def test_identities_that_are_no_rank_are_dropped(dp_server):
    """Non-numeric, out of range, and a message of three frames: today each kills the engine."""
    attack(dp_server, (b"attacker", b"x"), (b"7", b"x"), (None, b"x"), (b"0001", b"a", b"b"))


def test_a_forged_message_without_the_right_mac_is_dropped(dp_server):
    """A rank's "I am dead" message, forged: as a pickle, and as a frame in the new format with a
    MAC made without the secret. Today the pickle marks the engine dead (/health 503 for good)."""
    from nanoserve.request import EngineCoreOutputs
    forged = pickle.dumps(EngineCoreOutputs(dead=True, error="forged"))
    body = msgspec.msgpack.encode(["outputs", [], {}, {}, True, "forged"])
    unsigned = os.urandom(32) + (1 << 40).to_bytes(8, "big") + body
    attack(dp_server, (b"+1", forged), (b"1 ", unsigned))


def test_every_message_type_round_trips_through_the_codecs():
    """Handshake, then each message both ways, decoded against its type; SamplingParams with
    every field (each kind of structured output), logprobs, each error class of a failed request."""
    from nanoserve.config import Config
    from nanoserve.errors import EngineStepError
    from nanoserve.request import EngineCoreOutput, EngineCoreOutputs, Request
    from nanoserve.sampler import TokenLogprobs
    from nanoserve.sampling_params import SamplingParams, StructuredOutputsParams
    from nanoserve.serial_utils import (WIRE_ERRORS, CoreCodec, EngineCoreRequest, Output,
                                        Outputs, Ping, Ready, ServerCodec, StartupError,
                                        WireError)
    core, server, replies = CoreCodec(SECRET.encode(), 0), ServerCodec(SECRET.encode(), 1), []
    assert server.decode([b"0", core.hello()], replies.append) == (0, None)
    assert core.decode(replies[0][1]) is None and core.welcomed      # the Welcome
    kinds = [dict(json={"type": "object", "properties": {"a": {"enum": [1, 2.5, None]}}}),
             dict(json='{"type": "string"}'), dict(regex="a+b"), dict(choice=["yes", "no"]),
             dict(grammar='root ::= "x"'), dict(json_object=True)]
    requests = [Request(f"r{i}", [1, 2, 3 + i], SamplingParams(
        n=1, temperature=0.7, top_p=0.9, top_k=5, min_p=0.1, seed=2**63 - 1, max_tokens=9,
        min_tokens=0, stop=["x", "yz"], stop_token_ids=[4], ignore_eos=True,
        presence_penalty=0.5, frequency_penalty=-0.5, repetition_penalty=1.2, logprobs=3,
        skip_special_tokens=False, include_stop_str_in_output=True,
        structured_outputs=StructuredOutputsParams(**kind)), eos_token_id=2, arrival_time=12.5,
        priority=-3) for i, kind in enumerate(kinds)]
    kind, decoded = core.decode(server.encode(0, "add", requests)[1])
    assert kind == "add" and [vars(r) for r in decoded] == [vars(r) for r in requests]
    assert core.decode(server.encode(0, "abort", ["r0", "r1"])[1]) == ("abort", ["r0", "r1"])

    class GrammarRefused(ValueError):
        pass
    errors = [cls("why") for cls in WIRE_ERRORS.values()] + [
        EngineStepError("step", ["r0"]), GrammarRefused("no"), KeyError("k")]
    message = EngineCoreOutputs(
        [EngineCoreOutput("r0", [7], None, None, TokenLogprobs(-0.5, 2, [(3, -0.25), (7, -0.5)])),
         EngineCoreOutput("r1", [8, 9], "stop", 9)],
        {f"f{i}": e for i, e in enumerate(errors)},
        {"num_requests_running": 2, "kv_cache_usage_perc": 0.25, "per_pos_total": [3, 1]})
    rank, wire = server.decode([b"0", core.encode(Outputs.from_outputs(message))], replies.append)
    back = wire.to_outputs()
    assert rank == 0 and back.stats == message.stats and not back.dead
    assert [(o.request_id, o.new_token_ids, o.finish_reason, o.stop_reason) for o in back.outputs] \
        == [("r0", [7], None, None), ("r1", [8, 9], "stop", 9)]
    lp = back.outputs[0].new_logprobs
    assert (lp.logprob, lp.rank, lp.top) == (-0.5, 2, [(3, -0.25), (7, -0.5)])
    rebuilt = [(type(e), str(e)) for e in back.failed.values()]
    assert rebuilt[:len(WIRE_ERRORS)] == [(cls, "why") for cls in WIRE_ERRORS.values()]
    assert rebuilt[len(WIRE_ERRORS):] == [(EngineStepError, "step"), (ValueError, "no"),
                                          (RuntimeError, "KeyError: 'k'")]
    config = Config(speculative_config={"method": "ngram", "num_speculative_tokens": 3},
                    max_model_len=256, num_kv_blocks=64)
    ready = Ready(config, 384, "/m", {"num_requests_running": 0}, "cpu", 11, [12, 13])
    assert server.decode([b"0", core.encode(ready)], replies.append) == (0, ready)
    failure = StartupError(WireError.from_exception(OSError("no such model")))
    assert server.decode([b"0", core.encode(failure)], replies.append) == (0, failure)
    assert server.decode([b"0", core.encode(Ping())], replies.append) == (0, Ping())
    # The wire forms carry every field of the in-process classes (a new one needs its place).
    fields = lambda cls: {f.name for f in dataclasses.fields(cls)}
    assert fields(EngineCoreOutput) == set(Output.__struct_fields__)
    assert fields(EngineCoreOutputs) - {"engine_index"} == set(Outputs.__struct_fields__)
    assert set(inspect.signature(Request).parameters) == set(EngineCoreRequest.__struct_fields__)


def test_codecs_drop_bad_mac_replay_reflection_bad_values_and_strangers():
    from nanoserve.request import Request
    from nanoserve.sampling_params import SamplingParams
    from nanoserve.serial_utils import CoreCodec, Ping, ServerCodec
    core, server, replies = CoreCodec(SECRET.encode(), 1), ServerCodec(SECRET.encode(), 2), []
    server.decode([b"1", core.hello()], replies.append)
    core.decode(replies[0][1])
    frame = core.encode(Ping())
    assert server.decode([b"1", frame], replies.append) == (1, Ping())
    assert server.decode([b"1", frame], replies.append) == (1, None)          # a replay
    assert server.decode([b"0", core.encode(Ping())], replies.append) == (0, None)   # rank 1's
    wrong = CoreCodec(b"another secret, as long as it is", 1)
    assert server.decode([b"1", wrong.hello()], replies.append) == (1, None)  # bad MAC
    assert server.decode([b"x", frame], replies.append) == (None, None)
    assert server.decode([b"1"], replies.append) == (None, None)
    assert len(replies) == 1 and server.num_dropped_total == 5
    # Signed by the API server, but with values SamplingParams refuses: dropped, not raised.
    bad = Request("r", [1], SamplingParams())
    bad.sampling_params.top_p = 5.0
    assert core.decode(server.encode(1, "add", [bad])[1]) is None


def run_cli(*args: str, env: dict, timeout: float):
    return subprocess.run([sys.executable, "-m", "nanoserve.cli", "serve", *args, *FLAGS],
                          env=env, capture_output=True, text=True, timeout=timeout)


def test_remote_ranks_without_a_secret_are_refused(tmp_path):
    """Both ends refuse to start (a clear error naming the flag and the variable) instead of
    serving an unauthenticated port; a short secret too."""
    env = {k: v for k, v in os.environ.items() if k != "NANOSERVE_RPC_SECRET"}
    port = str(free_port())
    for args in (["--data-parallel-size", "2", "--data-parallel-size-local", "1"],
                 ["--headless", "--data-parallel-size", "2", "--data-parallel-rank", "1"]):
        result = run_cli("nanoserve-tiny", *args, "--data-parallel-rpc-port", port, env=env,
                         timeout=60)
        assert result.returncode != 0
        assert "NANOSERVE_RPC_SECRET" in result.stderr and "--data-parallel-rpc-secret" in result.stderr
    from nanoserve.config import Config
    from nanoserve.serial_utils import take_rpc_secret
    with pytest.raises(ValueError, match="NANOSERVE_RPC_SECRET"):
        take_rpc_secret(Config(data_parallel_size=2, data_parallel_size_local=1,
                               data_parallel_rpc_secret="short"))


def test_a_headless_rank_with_the_wrong_secret_is_refused_and_the_server_says_why():
    port = str(free_port())
    remote = ["--data-parallel-size", "2", "--data-parallel-rpc-port", port]
    server = subprocess.Popen(
        [sys.executable, "-m", "nanoserve.cli", "serve", "nanoserve-tiny",
         "--data-parallel-size-local", "1", "--port", str(free_port()), *remote, *FLAGS],
        env={**os.environ, "NANOSERVE_RPC_SECRET": SECRET}, stderr=subprocess.PIPE, text=True)
    headless = subprocess.Popen(
        [sys.executable, "-m", "nanoserve.cli", "serve", "nanoserve-tiny", "--headless",
         "--data-parallel-rank", "1", *remote, *FLAGS],
        env={**os.environ, "NANOSERVE_RPC_SECRET": "not the server's secret, 32+ chars"},
        stderr=subprocess.DEVNULL)
    lines = []
    threading.Thread(target=lambda: lines.extend(server.stderr), daemon=True).start()
    try:
        deadline = time.monotonic() + 120
        while not any("bad MAC" in line for line in lines) and time.monotonic() < deadline:
            time.sleep(0.2)
        log = "".join(lines)
        assert "bad MAC" in log and "NANOSERVE_RPC_SECRET" in log, log[-2000:]
        assert "Application startup complete" not in log     # it never served with rank 1
    finally:
        for proc in (server, headless):
            proc.kill()
            proc.wait()


def test_the_secret_is_in_no_trace_repr_or_ready_message(tmp_path, monkeypatch):
    from nanoserve import AsyncLLM
    from nanoserve.config import Config
    assert SECRET not in repr(Config(data_parallel_rpc_secret=SECRET))
    trace = tmp_path / "run.jsonl"
    with live_server(tmp_path / "m", trace=str(trace), data_parallel_rpc_secret=SECRET) as server:
        pass
    server.engine.engine_core.shutdown()
    assert server.engine.config.data_parallel_rpc_secret is None     # what "ready" carried
    assert SECRET not in repr(server.engine.config)
    events = [json.loads(line) for line in trace.read_text().splitlines()]
    assert events[0]["ev"] == "config" and SECRET not in trace.read_text()
    monkeypatch.setenv("NANOSERVE_RPC_SECRET", SECRET)     # from the environment: the same
    engine = AsyncLLM(server.path, **CONFIG, trace=str(trace))
    engine.engine_core.shutdown()
    assert SECRET not in trace.read_text()


def test_a_stopped_engine_core_is_dead_within_the_iteration_timeout(tmp_path):
    """SIGSTOP of the engine core mid-stream: silence past engine_iteration_timeout_s (3 s) ends
    the stream with an error and turns /health to 503 (today: frozen, /health 200)."""
    with live_server(tmp_path, engine_iteration_timeout_s=3) as server:
        ((_, pid),) = [p for p in server.engine.engine_core.processes if p[0] == "engine core 0"]
        try:
            body = completion_body(max_tokens=200)
            with server.client.stream("POST", "/v1/completions", json=body,
                                      timeout=httpx.Timeout(30.0)) as r:
                lines = (line for line in r.iter_lines() if line)
                assert "error" not in next(lines)
                os.kill(pid, signal.SIGSTOP)
                rest = list(lines)        # it ends: a ReadTimeout here is the bug
            errors = [json.loads(line[6:])["error"] for line in rest if '"error"' in line]
            assert errors and "sent nothing for 3 s" in errors[0]["message"], rest[-3:]
            health = server.client.get("/health")
            assert health.status_code == 503 and str(pid) in health.json()["error"]["message"]
        finally:
            os.kill(pid, signal.SIGCONT)
    server.engine.engine_core.shutdown()
