"""Fuzzing the HTTP API: hypothesis-made JSON bodies (wrong types, huge and negative numbers,
unicode, nested junk, bodies nested thousands deep, empty arrays, NaN and Infinity, values at the
types' edges (2**63, 2**64, 1e-300, 1e308), float and out-of-range token ids) against every
endpoint of a live server on loopback. Whatever arrives: never a 500, every error is OpenAI's
JSON, the engine keeps serving, and afterwards no request runs and no KV block is held.

    python -m pytest -q tests/test_fuzz.py
"""

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nanoserve import AsyncLLM
from nanoserve.protocol import MAX_JSON_DEPTH
from test_api import serve

CONFIG = dict(max_model_len=128, block_size=16, num_kv_blocks=32, device="cpu")
FUZZ = settings(max_examples=120, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture,
                                       HealthCheck.too_slow])

junk = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=True)
    | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=8)
token_ids = st.lists(st.integers(-5, 3000) | st.floats(-1, 3000) | st.booleans(), max_size=8)
prompt = (st.text(max_size=40) | st.lists(st.text(max_size=10), max_size=3) | token_ids
          | st.lists(token_ids, max_size=2) | junk)
small = st.integers(-3, 8)
# The types' edges (int64, uint64, float32's range, the smallest double): where a value that
# passes a check may still overflow inside the step.
edge_int = st.sampled_from([2**63 - 1, 2**63, 2**64 - 1, 2**64, -2**63, -2**63 - 1])
edge_float = st.sampled_from([1e-300, -1e-300, 1e308, -1e308, 3.5e38, 1e-45, float("nan"),
                              float("inf"), float("-inf")])
huge = st.integers(-2**64, 2**64) | edge_int
number = st.floats(allow_nan=True, allow_infinity=True) | st.integers(-10, 10) | edge_float
sampling = {
    "max_tokens": small | huge | junk, "n": small | junk, "temperature": number | junk,
    "top_p": number, "top_k": small | huge, "min_p": number, "seed": huge | junk,
    "stop": st.text(max_size=4) | st.lists(st.text(max_size=4), max_size=5) | junk,
    "stop_token_ids": token_ids | junk, "logprobs": small | st.booleans() | junk,
    "presence_penalty": number, "frequency_penalty": number, "repetition_penalty": number,
    "ignore_eos": st.booleans() | junk, "stream": st.booleans() | junk,
    "min_tokens": small | huge, "echo": st.booleans() | junk, "user": junk,
    "stream_options": junk | st.just({"include_usage": True}),
}
model = st.sampled_from(["nanoserve-tiny", "other"]) | junk
message = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "tool"]) | junk,
                                 "content": st.text(max_size=30) | junk})
completion_body = st.fixed_dictionaries({"model": model, "prompt": prompt},
                                        optional=sampling) | junk
chat_body = st.fixed_dictionaries(
    {"model": model, "messages": st.lists(message, max_size=3) | junk},
    optional={**sampling, "top_logprobs": small | junk, "max_completion_tokens": small | huge}) | junk


@pytest.fixture(scope="module")
def server():
    engine = AsyncLLM(**CONFIG)
    with serve(engine, "nanoserve-tiny") as url, httpx.Client(base_url=url, timeout=60) as client:
        yield client, engine
    stats = engine.get_stats()
    assert stats["num_requests_running"] == stats["num_requests_waiting"] == 0, stats
    assert stats["kv_cache_usage_perc"] == 0.0, stats        # no block leaked by any body


def post(client: httpx.Client, path: str, body) -> httpx.Response:
    # Python's json writes NaN / Infinity, as careless clients do; the server must refuse them.
    return client.post(path, content=json.dumps(body), headers={"content-type": "application/json"})


def check(response: httpx.Response) -> None:
    assert response.status_code < 500, response.text
    if response.status_code >= 400:
        error = response.json()["error"]
        assert isinstance(error["message"], str) and error["type"] == "invalid_request_error"
        assert "Traceback" not in error["message"]
    elif response.headers["content-type"].startswith("text/event-stream"):
        events = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        for event in events[:-1]:
            assert "error" not in json.loads(event), event


@FUZZ
@given(body=completion_body)
def test_completions_never_500(server, body):
    client, _ = server
    check(post(client, "/v1/completions", body))


@FUZZ
@given(body=chat_body)
def test_chat_completions_never_500(server, body):
    client, _ = server
    check(post(client, "/v1/chat/completions", body))


@settings(max_examples=60, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(raw=st.binary(max_size=64) | st.text(max_size=64).map(str.encode),
       path=st.sampled_from(["/v1/completions", "/v1/chat/completions", "/v1/models",
                             "/health", "/metrics", "/v1/nothing"]),
       method=st.sampled_from(["GET", "POST", "PUT", "DELETE"]))
def test_raw_bytes_on_every_endpoint_never_500(server, raw, path, method):
    client, _ = server
    response = client.request(method, path, content=raw,
                              headers={"content-type": "application/json"})
    assert response.status_code < 500, response.text
    if response.status_code >= 400:
        assert response.json()["error"]["message"]


@settings(max_examples=40, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(depth=st.integers(1, 6000), brackets=st.sampled_from(["[]", "{}"]),
       field=st.sampled_from(["prompt", "stop", "n", "stream_options", "messages"]),
       path=st.sampled_from(["/v1/completions", "/v1/chat/completions"]))
def test_deep_nesting_never_500(server, depth, brackets, field, path):
    """Arrays or objects nested up to 6,000 deep in any field (json.loads recurses): a 400 past
    MAX_JSON_DEPTH levels, never a RecursionError's 500."""
    client, _ = server
    start, end = ("[", "]") if brackets == "[]" else ('{"a": ', "}")
    raw = f'{{"model": "nanoserve-tiny", "{field}": {start * depth}1{end * depth}}}'.encode()
    response = client.post(path, content=raw, headers={"content-type": "application/json"})
    check(response)
    if depth + 1 > MAX_JSON_DEPTH:
        assert response.status_code == 400 and "nests deeper" in response.json()["error"]["message"]


@pytest.mark.parametrize("field", ["temperature", "top_p", "top_k", "min_p", "seed", "max_tokens",
                                   "min_tokens", "presence_penalty", "frequency_penalty",
                                   "repetition_penalty", "logprobs", "n"])
def test_every_sampling_field_at_the_types_edges(server, field):
    """Each edge in each field of an otherwise good request, streamed and not: a 400 or an
    answer, never a 500 nor an error mid-stream (a seed of 2**64 once failed the whole step)."""
    client, _ = server
    for value in (2**63 - 1, 2**63, 2**64, -2**63 - 1, 1e-300, 1e308, 1e-45, float("nan"),
                  float("inf")):
        for stream in (False, True):
            check(post(client, "/v1/completions", {"model": "nanoserve-tiny", "prompt": "Once",
                                                   "max_tokens": 2, "temperature": 1.0,
                                                   "stream": stream, field: value}))


def test_server_still_serves_after_fuzzing(server):
    client, _ = server
    response = client.post("/v1/completions", json={"model": "nanoserve-tiny", "prompt": "Once",
                                                     "max_tokens": 4, "temperature": 0})
    assert response.status_code == 200 and response.json()["choices"][0]["text"]
