"""The red-team kit: a live server on loopback and a victim stream to run beside each attack.

Every probe of the security tests (tests/test_security_*.py) has the same shape: a victim, an
honest client streaming a greedy completion, runs while the attacker sends its request; the
attack must fail alone (a 4xx, or an error on the attacker's own stream), and the victim's
tokens must equal the same stream run alone, before the attack.

    with live_server(tmp_path) as server:
        with victim(server) as v:           # streams in a thread while the block runs
            attack(server)                  # whatever the probe does
        assert v.text == server.expected    # untouched by the attack

    python -m pytest -q tests/test_security_*.py
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from types import SimpleNamespace
from typing import Optional

import httpx

VICTIM_PROMPT = "the quick brown fox"
VICTIM_TOKENS = 48
CONFIG = dict(max_model_len=256, block_size=16, num_kv_blocks=64, device="cpu")
MODEL = "tiny"


@contextlib.contextmanager
def live_server(path, *, api_key: Optional[str] = None, **config):
    """A tiny random checkpoint at `path`, served on a free loopback port (the engine core in
    its own process, as `nanoserve serve` runs it). Yields: url, engine, client (httpx, with the
    key), expected (the victim's text when it runs alone)."""
    from conftest import build_checkpoint
    from test_api import serve

    from nanoserve import AsyncLLM
    build_checkpoint(path, "llama")
    engine = AsyncLLM(str(path), **{**CONFIG, **config})
    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    with serve(engine, MODEL, api_key) as url, \
            httpx.Client(base_url=url, timeout=120, headers=headers) as client:
        server = SimpleNamespace(url=url, engine=engine, client=client, path=str(path))
        server.expected = stream_text(server)
        yield server


def completion_body(prompt: str = VICTIM_PROMPT, max_tokens: int = VICTIM_TOKENS, **fields) -> dict:
    return {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": True, **fields}


def stream_events(server, body: dict, path: str = "/v1/completions") -> tuple[int, list]:
    """POST a streamed request; (status, [each SSE event's JSON, or the error body])."""
    with server.client.stream("POST", path, json=body) as response:
        if response.status_code != 200:
            response.read()
            return response.status_code, [response.json()]
        events = [json.loads(line[6:]) for line in response.iter_lines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
        return 200, events


def stream_text(server, body: Optional[dict] = None) -> str:
    """The streamed completion's text; AssertionError if the stream errs or is refused."""
    status, events = stream_events(server, body or completion_body())
    assert status == 200, events
    errors = [e for e in events if "error" in e]
    assert not errors, errors
    return "".join(c["text"] for e in events for c in e["choices"])


@contextlib.contextmanager
def victim(server, body: Optional[dict] = None):
    """Run the victim's stream in a thread while the `with` block runs; once the block is done,
    wait for it. Yields a namespace whose `text` (or `error`) is set at the end. The block starts
    once the victim has its first token, so the attack lands mid-stream."""
    result = SimpleNamespace(text=None, error=None, first_token=threading.Event())

    def run():
        try:
            status, events = None, []
            with server.client.stream("POST", "/v1/completions",
                                      json=body or completion_body()) as response:
                status = response.status_code
                text = ""
                for line in response.iter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        event = json.loads(line[6:])
                        events.append(event)
                        if "error" in event:
                            result.error = event
                        else:
                            text += "".join(c["text"] for c in event["choices"])
                            result.first_token.set()
            if status != 200:
                result.error = f"HTTP {status}"
            result.text = text
        except Exception as e:      # noqa: BLE001 (the test reports it)
            result.error = f"{type(e).__name__}: {e}"
        finally:
            result.first_token.set()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    result.first_token.wait(60)
    try:
        yield result
    finally:
        thread.join(120)
        assert not thread.is_alive(), "the victim's stream never ended"


def assert_untouched(server, v) -> None:
    """The victim's stream ended well and equals its run alone; the server is still healthy."""
    assert v.error is None, f"the attack reached the victim: {v.error}"
    assert v.text == server.expected
    assert server.client.get("/health").status_code == 200


def wait_idle(server, timeout: float = 30.0) -> dict:
    """Wait until the engine holds no request and no KV block (nothing leaked); its stats."""
    deadline = time.monotonic() + timeout
    while True:
        stats = server.engine.get_stats()
        if (stats["num_requests_running"] == stats["num_requests_waiting"] == 0
                and stats["kv_cache_usage_perc"] == 0.0) or time.monotonic() > deadline:
            return stats
        time.sleep(0.05)
