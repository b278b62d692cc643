"""Red-team probes of failure isolation (issue 51, finding 2 and the leaks of 6 and 11): what one
request sends, or what goes wrong in its own row of a step, fails that request alone.

Each probe runs a victim stream (tests/security_kit.py) beside the attack: the victim's tokens
must equal its run alone, and afterwards the engine holds no request and no KV block.

- values the step cannot take are refused at the edge, 400 naming the field: a seed past int64,
  a float that is NaN, inf or past float32's range;
- a temperature below 0.01 is raised to it (vLLM's rule), so it cannot make the logits NaN;
- inside the step, a NaN row, or a token its grammar refuses, fails that request alone, with an
  error that names no other client's request.

    python -m pytest -q tests/test_security_isolation.py
"""

from __future__ import annotations

import json
import re

import pytest
import torch

from security_kit import (assert_untouched, completion_body, live_server, stream_events,
                          victim, wait_idle)

from nanoserve.sampling_params import SamplingParams

CHOICES = ["yes", "no"]
MARK = 3      # the attacker's `logprobs`: how a poisoned sampler finds the attacker's row


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with live_server(tmp_path_factory.mktemp("isolation")) as server:
        yield server


@pytest.fixture(scope="module")
def inproc(tmp_path_factory):
    """The engine core in a thread of this process (--no-engine-process): its runner can be
    monkeypatched to break one request's row."""
    with live_server(tmp_path_factory.mktemp("isolation_inproc"), engine_process=False) as server:
        yield server


def attack(server, **fields) -> tuple[int, list]:
    return stream_events(server, completion_body("an attacker's prompt", 8, **fields))


def errors_of(status: int, events: list) -> list[str]:
    """The error messages the attacker got: an HTTP error's, or its stream's error events."""
    return [e["error"]["message"] for e in events if "error" in e]


def assert_names_only_itself(events: list, messages: list[str]) -> None:
    """No error names a request id other than the attacker's own (OpenAI ids: cmpl-<hex>)."""
    own = {e["id"] for e in events if "id" in e}
    for message in messages:
        assert set(re.findall(r"cmpl-[0-9a-f]+", message)) <= own, message


def assert_clean(server, v) -> None:
    assert_untouched(server, v)
    stats = wait_idle(server)
    assert stats["num_requests_running"] == stats["num_requests_waiting"] == 0, stats
    assert stats["kv_cache_usage_perc"] == 0.0, stats     # no block leaked


# -- at the edge: SamplingParams (both front ends) and HTTP 400 ------------------------------
@pytest.mark.parametrize("seed", [2**64, 2**63, -2**63 - 1])
def test_a_seed_past_int64_is_a_400_naming_seed(server, seed):
    with victim(server) as v:
        status, events = attack(server, seed=seed, temperature=1.0)
    assert status == 400, events
    assert events[0]["error"]["param"] == "seed" and "seed" in events[0]["error"]["message"]
    assert_clean(server, v)


@pytest.mark.parametrize("field", ["repetition_penalty", "temperature"])
@pytest.mark.parametrize("value", ["Infinity", "1e308"])
def test_non_finite_numbers_are_a_400(server, field, value):
    """Infinity and 1e308 (inf in the sampler's float32) were served with a 200 (the fields with
    a bounded range, and NaN, were refused already: the fuzz test covers them)."""
    body = json.dumps({**completion_body("an attacker's prompt", 8), field: "VALUE"})
    body = body.replace('"VALUE"', value)       # NaN and Infinity as careless JSON writers send
    with victim(server) as v:
        response = server.client.post("/v1/completions", content=body,
                                      headers={"content-type": "application/json"})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["type"] == "invalid_request_error"
    if value == "1e308":          # valid JSON: SamplingParams names the field
        assert field in response.json()["error"]["message"]
    assert_clean(server, v)


def test_sampling_params_refuse_what_the_step_cannot_take():
    for fields in ({"seed": 2**64}, {"seed": -2**63 - 1}, {"temperature": float("nan")},
                   {"temperature": float("inf")}, {"repetition_penalty": 1e308},
                   {"repetition_penalty": float("inf")}, {"top_p": float("nan")}):
        name = next(iter(fields))
        with pytest.raises(ValueError, match=f"^{name} "):
            SamplingParams(**fields)
    assert SamplingParams(seed=2**63 - 1).seed == 2**63 - 1
    assert SamplingParams(seed=-2**63).seed == -2**63
    # vLLM's rule: 0 < temperature < 0.01 is raised to 0.01; 0 stays greedy.
    assert SamplingParams(temperature=1e-300).temperature == 0.01
    assert SamplingParams(temperature=0.0).is_greedy


def test_a_tiny_temperature_with_a_grammar_fails_nobody_else(server):
    """1e-300 was 0.0 in float32: the logits became NaN, token 0 was sampled, the grammar refused
    it, and the whole step failed, the victim with an error naming the attacker's request."""
    with victim(server) as v:
        status, events = attack(server, temperature=1e-300,
                                structured_outputs={"choice": CHOICES})
    messages = errors_of(status, events)
    assert_names_only_itself(events, messages)
    if not messages:                 # a well-formed answer: one of the choices
        assert status == 200
        assert "".join(c["text"] for e in events for c in e["choices"]) in CHOICES
    assert_clean(server, v)


# -- inside the step: one row's fault fails its request alone -------------------------------
def test_a_nan_row_fails_only_its_request(inproc, monkeypatch):
    """The attacker's row of logits is NaN (as a model's overflow would make it): its request
    fails with its own error; before, the argmax took the NaN and answered token 0."""
    runner = inproc.engine.engine_core.core.runner
    real = runner.sampler

    def poisoned(logits, md):
        rows = [i for i, k in enumerate(md.num_logprobs) if k == MARK]
        logits = logits.clone()
        logits[rows] = float("nan")
        return real(logits, md)
    monkeypatch.setattr(runner, "sampler", poisoned)
    for fields in ({"temperature": 0.0}, {"temperature": 1.0, "seed": 7}):
        with victim(inproc) as v:
            status, events = attack(inproc, logprobs=MARK, **fields)
        messages = errors_of(status, events)
        assert messages and "not finite" in messages[0], (status, events)
        assert_names_only_itself(events, messages)
        assert_clean(inproc, v)


def test_a_grammar_refusal_fails_only_its_request(inproc, monkeypatch):
    """The attacker's sampled token is one its grammar forbids: before, accept_tokens raised
    and the whole step failed, the victim with an error naming the attacker's request."""
    runner = inproc.engine.engine_core.core.runner
    real = runner.sampler

    def refused(logits, md):
        out = real(logits, md)
        if md.grammar_bitmask is not None:
            for i, row in enumerate(md.grammar_rows.tolist()):
                bits = (md.grammar_bitmask[i].cpu()[:, None] >> torch.arange(32)) & 1
                forbidden = (bits.flatten()[:md.vocab_size] == 0).nonzero()[0, 0]
                out.sampled_token_ids[row] = forbidden
        return out
    monkeypatch.setattr(runner, "sampler", refused)
    with victim(inproc) as v:
        status, events = attack(inproc, structured_outputs={"choice": CHOICES})
    messages = errors_of(status, events)
    assert messages and "grammar refused" in messages[0], (status, events)
    assert_names_only_itself(events, messages)
    assert_clean(inproc, v)


def test_a_failed_step_names_no_other_request(inproc, monkeypatch):
    """A whole step that raises (a bug) still fails the step's requests, but its message is
    shown only when it names none of them."""
    runner = inproc.engine.engine_core.core.runner
    real, calls = runner.execute_model, []

    def fail_once(out):
        calls.append(1)
        if len(calls) == 1:
            raise KeyError(out.requests[-1].request_id)
        return real(out)
    monkeypatch.setattr(runner, "execute_model", fail_once)
    status, events = attack(inproc)
    messages = errors_of(status, events)
    assert messages and "KeyError" in messages[0] and "cmpl-" not in messages[0], messages
    assert stream_events(inproc, completion_body())[0] == 200     # the engine goes on
    wait_idle(inproc)
