"""Red-team probes of the HTTP layer (issue 51, findings 4-8 and 11's API key and error ids):
tokenizing off the event loop and a character cap before it, stop-string caps, admission by
sequences, strict shallow JSON, JSON-only bodies, the Host check, CORS, a deadline on request
heads, the API key from the environment, errors naming the client's own request only. Each
attack runs beside the kit's victim stream, which must come out untouched.

    python -m pytest -q tests/test_security_http.py
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import httpx
import pytest
from security_kit import (CONFIG, MODEL, VICTIM_PROMPT, assert_untouched, completion_body,
                          live_server, stream_events, stream_text, victim, wait_idle)
from test_api import serve_app

from nanoserve import AsyncLLM, SamplingParams
from nanoserve.errors import EngineOverloadedError

ORIGIN = "https://app.example"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with live_server(tmp_path_factory.mktemp("http")) as server:
        yield server


def post(server, body, path: str = "/v1/completions", **headers) -> httpx.Response:
    """POST raw bytes (or JSON of `body`) as application/json unless headers say otherwise."""
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return server.client.post(path, content=content,
                              headers={"content-type": "application/json", **headers})


def assert_error(response: httpx.Response, status: int, param=None, says: str = "") -> dict:
    """OpenAI's error JSON with this status (and param), its message containing `says`."""
    assert response.status_code == status, response.text[:300]
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert error["param"] == param and says in error["message"], error
    return error


def while_in_flight(attack, check, timeout: float = 120.0):
    """Run `attack()` in a thread; call `check()` again and again until it has returned."""
    result = {}
    thread = threading.Thread(target=lambda: result.update(response=attack()), daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout
    while thread.is_alive():
        assert time.monotonic() < deadline, "the attack never ended"
        check()
        time.sleep(0.05)
    return result["response"]


def reached_engine(server, before: int) -> int:
    """Prompt tokens the engine was sent since `before`, less one victim's."""
    victim_tokens = len(server.engine.tokenizer.encode(VICTIM_PROMPT))
    return server.engine.get_stats()["prompt_tokens_total"] - before - victim_tokens


def health_answers(server, within: float):
    """/health answers 200 within `within` seconds (httpx raises a timeout otherwise)."""
    def check():
        with httpx.Client(timeout=within) as client:
            assert client.get(server.url + "/health").status_code == 200
    return check


# -- finding 4: tokenizing, the prompt's length, stop strings --------------------------------
def test_a_7_8_mb_prompt_is_refused_by_its_length_while_health_answers(server):
    """Refused by character length before the tokenizer sees it (today it was tokenized on
    the event loop first: /health stalled for seconds)."""
    before = server.engine.get_stats()["prompt_tokens_total"]
    body = completion_body(prompt="a" * 7_800_000, stream=False)
    with victim(server) as v:
        response = while_in_flight(lambda: post(server, body), health_answers(server, 2.0))
    assert_error(response, 400, "prompt", "characters")
    assert_untouched(server, v)
    assert reached_engine(server, before) == 0


def test_tokenizing_runs_off_the_event_loop(server, monkeypatch):
    """A prompt that fits but is slow to tokenize (a long context's) holds no other request:
    /health answers while it is encoded."""
    tokenizer, real = server.engine.tokenizer, server.engine.tokenizer.encode

    def slow_encode(*args, **kwargs):
        time.sleep(3)
        return real(*args, **kwargs)
    with victim(server) as v:
        monkeypatch.setattr(tokenizer, "encode", slow_encode)
        response = while_in_flight(lambda: post(server, completion_body("hello", 2, stream=False)),
                                   health_answers(server, 1.0))
        monkeypatch.undo()
    assert response.status_code == 200, response.text
    assert_untouched(server, v)


def test_stop_strings_are_capped(server):
    """300k stop strings with n = 16 took 28 s and stalled /health; now a 400 naming the field.
    64 strings of 1,024 characters still run."""
    with victim(server) as v:
        assert_error(post(server, completion_body(stop=["x"] * 300_000, n=16, stream=False)),
                     400, "stop", "at most 64")
        assert_error(post(server, completion_body(stop=["x"] * 65, stream=False)), 400, "stop")
        assert_error(post(server, completion_body(stop=["x" * 1025], stream=False)), 400, "stop")
        assert_error(post(server, completion_body(stop_token_ids=[1] * 65, stream=False)),
                     400, "stop_token_ids")
        ok = post(server, completion_body(stop=[f"{i:04d}" * 256 for i in range(64)],
                                          max_tokens=2, stream=False))
        assert ok.status_code == 200, ok.text
    assert_untouched(server, v)


# -- finding 5: admission counts sequences ---------------------------------------------------
def test_100_token_id_prompts_with_n_128_are_refused_and_nothing_queued(server):
    """100 prompts x n = 128 = 12,800 sequences, past max_waiting_requests (512): a 400 naming
    n, before anything reaches the engine (today all of them were queued)."""
    before = server.engine.get_stats()["prompt_tokens_total"]
    with victim(server) as v:
        status, events = stream_events(server, completion_body(prompt=[[5, 6, 7]] * 100, n=128,
                                                               max_tokens=1))
        assert status == 400 and events[0]["error"]["param"] == "n", (status, events[:1])
    assert_untouched(server, v)
    assert wait_idle(server)["num_requests_waiting"] == 0 and reached_engine(server, before) == 0


def test_max_waiting_requests_bounds_waiting_sequences(tmp_path):
    """Admission counts a request's sequences (n), not the request: with 4 allowed, n = 3 waits
    and n = 2 more is a 503 (EngineOverloadedError); n = 5 could never fit, so it is a 400
    (ValueError). The engine never sees "add" here, so the first request waits for good."""
    from conftest import build_checkpoint
    build_checkpoint(tmp_path, "llama")
    engine = AsyncLLM(str(tmp_path), **CONFIG, engine_process=False, max_waiting_requests=4)
    send = engine.engine_core.send
    engine.engine_core.send = lambda kind, payload: None if kind == "add" else send(kind, payload)

    async def first(n: int, request_id: str):
        return await anext(engine.generate("hello", SamplingParams(n=n, max_tokens=2), request_id))

    async def scenario():
        held = asyncio.create_task(first(3, "held"))
        await asyncio.sleep(0.5)
        assert not held.done()
        with pytest.raises(EngineOverloadedError, match="max_waiting_requests"):
            await first(2, "over")
        with pytest.raises(ValueError, match="could never be admitted"):
            await first(5, "never")
        held.cancel()
        await engine.shutdown()
    asyncio.run(asyncio.wait_for(scenario(), 60))
    assert engine.get_stats()["requests_rejected_total"] == 1


# -- finding 6: strict, shallow JSON ---------------------------------------------------------
def test_a_body_nested_5000_deep_is_a_400(server):
    """Today a RecursionError and an HTTP 500 with a traceback; the depth is checked before
    parsing. Brackets inside strings do not count, and 64 levels are still parsed."""
    head = b'{"model": "tiny", "max_tokens": 1, "prompt": '
    with victim(server) as v:
        for depth in (5000, 65):
            assert_error(post(server, head + b"[" * (depth - 1) + b"]" * (depth - 1) + b"}"),
                         400, None, "nests deeper than 64")
        assert_error(post(server, head + b"[" * 63 + b"1" + b"]" * 63 + b"}"), 400, "prompt")
        assert post(server, completion_body("[{" * 40, 1, stream=False)).status_code == 200
    assert_untouched(server, v)


@pytest.mark.parametrize("constant", ["NaN", "Infinity", "-Infinity"])
def test_nan_and_infinity_are_not_json(server, constant):
    """`"repetition_penalty": Infinity` returned 200: Python's json reads these, JSON has none."""
    body = json.dumps(completion_body(stream=False))[:-1] + f', "repetition_penalty": {constant}}}'
    with victim(server) as v:
        assert_error(post(server, body.encode()), 400, None, "not a JSON number")
    assert_untouched(server, v)


# -- finding 8: cross-site requests ----------------------------------------------------------
def test_only_json_bodies_are_served(server):
    """A text/plain or form POST, which a browser sends cross-site without a preflight, is a
    415; a charset parameter is fine."""
    before = server.engine.get_stats()["prompt_tokens_total"]
    body = completion_body(max_tokens=1, stream=False)
    with victim(server) as v:
        for kind in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data"):
            assert_error(post(server, body, **{"content-type": kind}), 415, None, "JSON")
        assert_error(server.client.post("/v1/completions", content=json.dumps(body)), 415)
    assert_untouched(server, v)
    assert reached_engine(server, before) == 0
    ok = post(server, body, **{"content-type": "application/json; charset=utf-8"})
    assert ok.status_code == 200, ok.text


def test_a_loopback_server_answers_only_loopback_host_names(server):
    """DNS rebinding: a page at evil.example whose name now resolves to 127.0.0.1 sends
    Host: evil.example. Refused; localhost, 127.0.0.1 and [::1] (any port) are answered."""
    port = server.url.rsplit(":", 1)[1]
    before = server.engine.get_stats()["prompt_tokens_total"]
    with victim(server) as v:
        for host in ("evil.example", f"evil.example:{port}", "127.0.0.1.evil.example"):
            assert server.client.get("/health", headers={"host": host}).status_code == 400
            refused = post(server, completion_body(max_tokens=1, stream=False), host=host)
            assert refused.status_code == 400
        for host in (f"localhost:{port}", f"127.0.0.1:{port}", f"[::1]:{port}", "localhost"):
            assert server.client.get("/health", headers={"host": host}).status_code == 200
    assert_untouched(server, v)
    assert reached_engine(server, before) == 0


@pytest.fixture(scope="module")
def configured(server):
    """A second app on its own in-process engine, set up as `nanoserve serve
    --allowed-origins https://app.example --timeout-request-head 1` sets it up."""
    import functools

    from nanoserve.api import build_app
    from nanoserve.http_limits import H11Protocol
    engine = AsyncLLM(server.path, **CONFIG, engine_process=False)
    app = build_app(engine, MODEL, allowed_origins=[ORIGIN])
    with serve_app(app, http=functools.partial(H11Protocol, timeout_request_head=1.0)) as url, \
            httpx.Client(base_url=url, timeout=60) as client:
        yield SimpleNamespace(url=url, engine=engine, client=client, path=server.path,
                              expected=server.expected)


def test_cors_headers_only_for_allowed_origins(server, configured):
    """No Access-Control-Allow-Origin by default (a page elsewhere cannot read an answer or
    send JSON); with --allowed-origins, for those origins only."""
    preflight = {"access-control-request-method": "POST",
                 "access-control-request-headers": "content-type, authorization"}
    for s, allowed in ((server, ()), (configured, (ORIGIN,))):
        with victim(s) as v:
            for origin in (ORIGIN, "https://evil.example"):
                answer = s.client.get("/v1/models", headers={"origin": origin})
                options = s.client.options("/v1/completions", headers={"origin": origin,
                                                                       **preflight})
                expected = origin if origin in allowed else None
                assert answer.headers.get("access-control-allow-origin") == expected
                assert options.headers.get("access-control-allow-origin") == expected
                assert (options.status_code == 200) == (origin in allowed)
        assert_untouched(s, v)


# -- finding 7: slow and idle connections ----------------------------------------------------
def test_connections_with_unfinished_heads_are_closed(configured):
    """50 connections each sending half a request line (a slowloris) are closed once the
    request-head timeout (1 s here) has passed; today they stayed open for good."""
    port = int(configured.url.rsplit(":", 1)[1])
    with victim(configured) as v, contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.create_connection(("127.0.0.1", port), timeout=5))
                 for _ in range(50)]
        for sock in socks:
            sock.sendall(b"POST /v1/completions HTT")
        deadline = time.monotonic() + 1.0 + 10.0
        for sock in socks:                 # a socket.timeout here: still open, the test fails
            sock.settimeout(max(0.01, deadline - time.monotonic()))
            with contextlib.suppress(ConnectionResetError):
                assert sock.recv(1024) == b""
    assert_untouched(configured, v)
    assert stream_text(configured) == configured.expected     # new connections are served


# -- finding 11: the API key from the environment, errors naming one's own request ------------
def test_api_key_from_the_environment(monkeypatch, capsys):
    """NANOSERVE_API_KEY (vLLM reads VLLM_API_KEY) keeps the key out of `ps`; --api-key wins;
    --help does not show it. The HTTP limits' flags have safe defaults."""
    from nanoserve.cli import build_parser
    monkeypatch.setenv("NANOSERVE_API_KEY", "s3cret-from-env")
    args = build_parser().parse_args(["serve"])
    assert args.api_key == "s3cret-from-env"
    assert build_parser().parse_args(["serve", "--api-key", "k"]).api_key == "k"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    assert "s3cret" not in capsys.readouterr().out
    assert (args.allowed_origins, args.allowed_hosts) == ([], None)
    assert (args.limit_concurrency, args.timeout_keep_alive, args.timeout_request_head) == (
        1024, 5, 10.0)
    monkeypatch.delenv("NANOSERVE_API_KEY")
    assert build_parser().parse_args(["serve"]).api_key is None


def test_a_failed_step_names_no_other_clients_request(server, monkeypatch):
    """A step that fails for everyone in it (here: an error naming every request of the step)
    reaches each client with its own request id only; the others' are "another request"."""
    from test_api import serve
    engine = AsyncLLM(server.path, **CONFIG, engine_process=False)
    executor, failed = engine.engine_core.core.executor, threading.Event()
    real = executor.execute_model

    def fail_naming_every_request(scheduler_output, *args):
        ids = sorted({r.request_id for r in scheduler_output.requests})
        if len(ids) >= 2 and not failed.is_set():
            failed.set()
            raise RuntimeError(f"rows of {ids} failed")
        return real(scheduler_output, *args)
    monkeypatch.setattr(executor, "execute_model", fail_naming_every_request)
    with serve(engine, MODEL) as url:
        kit = SimpleNamespace(client=httpx.Client(base_url=url, timeout=60))
        with kit.client, ThreadPoolExecutor(2) as pool:
            results = list(pool.map(lambda _: stream_events(kit, completion_body(max_tokens=200)),
                                    range(2)))
    assert failed.is_set()
    named_by_each = []
    for _, events in results:          # a 500 before the first token, or an error event after
        own = {e["id"] for e in events if "id" in e}      # (none in a 500)
        (error,) = [e["error"]["message"] for e in events if "error" in e]
        named = set(re.findall(r"cmpl-[0-9a-f]{32}", error))
        assert len(named) <= 1 and (not own or named <= own) and "another request" in error, error
        named_by_each.append(named)
    assert not named_by_each[0] & named_by_each[1]
