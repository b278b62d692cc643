"""Red-team probes of grammar compiles (issue 51, finding 3): nothing a grammar does blocks the
step loop.

- a grammar past a limit (its text's size, its enum values or choices, its schema's nesting) is
  a 400 naming the field, before anything compiles: the issue's 50,000-value enum took 30 s;
- a slow compile runs beside the step loop: the request waits as WAITING_FOR_FSM while the
  others step, then runs (vLLM's way);
- a compile past COMPILE_TIMEOUT_S fails its request alone, at the front end (400) or in the
  engine core (EngineCoreOutputs.failed), and a text still compiling is not compiled again.

Each probe runs a victim stream beside the attack (tests/security_kit.py), or, in the engine
core's own loop, a victim request: its tokens must equal its run alone, and no block leaks.
The slow compiles are xgrammar's compile patched to sleep (a real one that slow would be past
the limits), so the engine core runs in this process.

    python -m pytest -q tests/test_security_grammar.py
"""

from __future__ import annotations

import queue
import threading
import time
import uuid

import pytest

from security_kit import (CONFIG, assert_untouched, completion_body, live_server,
                          stream_events, victim, wait_idle)

from nanoserve import LLM, SamplingParams, structured_output
from nanoserve.engine_core import run_busy_loop
from nanoserve.sampling_params import StructuredOutputsParams

SIZE, DEPTH, VALUES = 32 * 1024, 32, 1000   # the limits probed: structured_output.py's


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """The engine core in a thread of this process (--no-engine-process), so that a patched
    compile is the engine's too. The limits are the front end's in either layout."""
    with live_server(tmp_path_factory.mktemp("grammar"), engine_process=False) as server:
        yield server


def schema_format(schema: dict) -> dict:
    return {"response_format": {"type": "json_schema",
                                "json_schema": {"name": "x", "schema": schema}}}


def nested_arrays(depth: int) -> dict:
    """A schema `depth` levels deep: arrays of arrays of ... of integers."""
    schema = {"type": "integer"}
    for _ in range(depth - 1):
        schema = {"type": "array", "items": schema}
    return schema


def refused(server, fields: dict, param: str, words: str) -> None:
    status, events = stream_events(server, completion_body("an attacker's prompt", 8, **fields))
    assert status == 400, (status, str(events)[:300])
    error = events[0]["error"]
    assert error["param"] == param and words in error["message"], error


@pytest.mark.parametrize("fields, param, words", [
    # the probe: 50,000 values, 0.49 MB (30 s to compile on 2 Xeon cores)
    (schema_format({"type": "string", "enum": [f"v{i}" for i in range(50_000)]}),
     "response_format", f"more than the limit of {SIZE}"),
    (schema_format({"type": "string", "enum": [f"v{i}" for i in range(VALUES + 1)]}),
     "response_format", f"{VALUES + 1} enum values or choices, more than the limit"),
    ({"structured_outputs": {"choice": [f"c{i}" for i in range(VALUES + 1)]}},
     "structured_outputs", "more than the limit"),
    ({"structured_outputs": {"regex": "a" * (SIZE + 1)}}, "structured_outputs",
     f"{SIZE + 1} bytes, more than the limit of {SIZE}"),
], ids=["issue-enum-50000", "enum-count", "choice-count", "regex-size"])
def test_a_grammar_past_a_limit_is_400_before_it_compiles(server, fields, param, words):
    with victim(server) as v:
        refused(server, fields, param, words)
    assert_untouched(server, v)
    assert wait_idle(server)["num_requests_waiting"] == 0


def test_a_schema_nested_past_the_limit_is_400_and_one_at_the_limits_runs(server):
    with victim(server) as v:
        refused(server, schema_format(nested_arrays(DEPTH + 8)), "response_format",
                f"nests more than {DEPTH} levels deep")
        deep_text = '{"items":' * 3000 + "{}" + "}" * 3000   # 30 KB, past the json module's
        refused(server, {"structured_outputs": {"json": deep_text}}, "structured_outputs",
                "levels deep")                             # own recursion limit
    assert_untouched(server, v)
    at_limits = {"type": "array", "items": {"enum": [f"v{i}" for i in range(VALUES - 1)]}}
    for schema in (nested_arrays(DEPTH), at_limits):
        status, events = stream_events(server, completion_body("hi", 4, **schema_format(schema)))
        assert status == 200 and not any("error" in e for e in events), str(events)[:300]


def slow_compiles(monkeypatch, seconds: float, marker: str) -> list[str]:
    """xgrammar's compile of a grammar whose text holds `marker` takes `seconds` longer; the
    list of those compiles, filled as they start."""
    compile_fast, calls = structured_output._compile, []

    def compile_slowly(compiler, params):
        if marker in params.text:
            calls.append(params.text)
            time.sleep(seconds)
        return compile_fast(compiler, params)
    monkeypatch.setattr(structured_output, "_compile", compile_slowly)
    return calls


def test_a_compile_past_the_timeout_is_400_compiled_once_and_touches_nobody(server,
                                                                           monkeypatch):
    monkeypatch.setattr(structured_output, "COMPILE_TIMEOUT_S", 1.0, raising=False)
    marker = f"slow-{uuid.uuid4().hex}"
    calls = slow_compiles(monkeypatch, 4.0, marker)
    fields = {"structured_outputs": {"choice": [marker, "b"]}}
    with victim(server) as v:
        attackers = [threading.Thread(target=refused, args=(
            server, fields, "structured_outputs", "took longer than 1 s to compile"))
            for _ in range(2)]
        for attacker in attackers:
            attacker.start()
        for attacker in attackers:
            attacker.join(60)
    assert_untouched(server, v)
    assert len(calls) == 1, calls      # one compile for both: the second waited for the first
    stats = wait_idle(server)
    assert stats["num_requests_running"] == stats["num_requests_waiting"] == 0
    assert stats["kv_cache_usage_perc"] == 0.0


# -- the engine core's own loop (run_busy_loop, as the server runs it) ---------------------------
@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    from conftest import build_checkpoint
    path = tmp_path_factory.mktemp("grammar_core")
    build_checkpoint(path, "llama")
    return LLM(str(path), **CONFIG)


class Loop:
    """run_busy_loop over `llm`'s engine core in a thread: `add` sends it requests, `until`
    gathers what it sends back (each request's tokens and the time each came, its finish
    reason, the failed) until the named requests are done."""

    def __init__(self, llm):
        self.core, self.inputs, self.sent = llm.engine, queue.Queue(), queue.Queue()
        self.thread = threading.Thread(target=run_busy_loop, daemon=True,
                                       args=(self.core, self._get, self.sent.put))
        self.tokens, self.times, self.finished, self.failed = {}, {}, {}, {}
        self.thread.start()

    def _get(self, wait_s) -> list:
        items = [] if wait_s == 0 else [self.inputs.get(timeout=60)]     # None: until one comes
        while not self.inputs.empty():
            items.append(self.inputs.get())
        return items

    def add(self, *requests) -> None:
        self.inputs.put(("add", list(requests)))

    def until(self, done, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while not done():
            message = self.sent.get(timeout=max(deadline - time.monotonic(), 0.01))
            assert not message.dead, message.error
            self.failed.update(message.failed)
            for out in message.outputs:
                self.tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
                self.times.setdefault(out.request_id, []).append(time.monotonic())
                if out.finish_reason:
                    self.finished[out.request_id] = out.finish_reason

    def close(self) -> None:
        self.inputs.put(("shutdown", None))
        self.thread.join(30)

    def max_gap(self, request_id: str) -> float:
        times = self.times[request_id]
        return max(b - a for a, b in zip(times, times[1:]))


def victim_request(llm, request_id: str):
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    return llm.processor.make_requests(request_id, [5, 6, 7, 8], params)[0]


def structured_request(llm, request_id: str, choices: list[str]):
    """Made (and compiled by the front end) before the compile is patched to be slow: the
    engine core's own compile is the slow one, as it is a fresh one in its own process."""
    params = SamplingParams(temperature=0.0, max_tokens=64,
                            structured_outputs=StructuredOutputsParams(choice=choices))
    return llm.processor.make_requests(request_id, [9, 10], params)[0]


def test_a_slow_compile_does_not_stall_the_step_loop(llm, monkeypatch):
    marker = f"slow-{uuid.uuid4().hex}"
    slow = structured_request(llm, "slow", [marker, "b"])
    loop = Loop(llm)
    try:
        loop.add(victim_request(llm, "alone"))
        loop.until(lambda: "alone" in loop.finished)
        slow_compiles(monkeypatch, 3.0, marker)
        loop.add(victim_request(llm, "victim"))
        loop.until(lambda: "victim" in loop.tokens)
        loop.add(slow)
        loop.until(lambda: {"victim", "slow"} <= set(loop.finished) | set(loop.failed))
    finally:
        loop.close()
    assert loop.tokens["victim"] == loop.tokens["alone"]
    # alone its gaps are milliseconds; waiting for the compile (3 s) made them seconds
    assert loop.max_gap("victim") < 1.0, (loop.max_gap("victim"), loop.max_gap("alone"))
    assert not loop.failed and loop.finished["slow"] == "stop"
    assert llm.tokenizer.decode(loop.tokens["slow"], skip_special_tokens=True) in (marker, "b")


def test_a_compile_past_the_timeout_fails_its_request_alone_in_the_engine_core(llm,
                                                                               monkeypatch):
    marker = f"slow-{uuid.uuid4().hex}"
    slow = structured_request(llm, "late", [marker, "b"])
    monkeypatch.setattr(structured_output, "COMPILE_TIMEOUT_S", 0.5, raising=False)
    slow_compiles(monkeypatch, 3.0, marker)
    loop = Loop(llm)
    try:
        loop.add(victim_request(llm, "alone2"))
        loop.until(lambda: "alone2" in loop.finished)
        loop.add(victim_request(llm, "victim2"), slow)
        loop.until(lambda: "victim2" in loop.finished and "late" in loop.failed | loop.finished)
    finally:
        loop.close()
    assert "took longer than 0.5 s to compile" in str(loop.failed.get("late")), loop.finished
    assert loop.tokens["victim2"] == loop.tokens["alone2"]
    core = llm.engine
    assert not core.has_unfinished_requests() and not core.structured_output.compiling
    assert core.kv_cache_manager.pool.num_free_blocks == core.kv_cache_manager.num_blocks
