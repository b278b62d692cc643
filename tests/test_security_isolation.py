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
import time

import pytest
import torch

from security_kit import (assert_untouched, completion_body, live_server, stream_events,
                          stream_text, victim, wait_idle)

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


@pytest.fixture
def runner(inproc, monkeypatch):
    """The in-process engine's runner, its steps slowed to 10 ms so that the attack lands while
    the victim streams (alone, nanoserve-tiny's 48 tokens take ~40 ms)."""
    runner = inproc.engine.engine_core.core.executor.model_runner
    real = runner.execute_model

    def slow(out):
        time.sleep(0.01)
        return real(out)
    monkeypatch.setattr(runner, "execute_model", slow)
    return runner


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
                   {"repetition_penalty": float("inf")}, {"repetition_penalty": 1e-40},
                   {"top_p": float("nan")}):
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
@pytest.mark.parametrize("temperatures", [[0.0] * 4, [1.0] * 4, [0.0, 1.0, 0.0, 1.0]])
def test_the_sampler_marks_each_row_that_is_not_finite(temperatures):
    """A NaN, an inf, or every token masked: that row's token is -1 (its request fails alone);
    the others are the tokens of the same rows without the bad ones. Before, such a row got a
    token (0, the argmax of NaN)."""
    from nanoserve.sampler import Sampler, SamplingMetadata
    vocab = 50
    clean = torch.randn(4, vocab, generator=torch.Generator().manual_seed(0))
    logits = clean.clone()
    logits[1, 7], logits[2, 3], logits[3] = float("nan"), float("inf"), float("-inf")
    params = [SamplingParams(temperature=t, seed=i) for i, t in enumerate(temperatures)]

    def sample(x):
        md = SamplingMetadata.from_requests(
            params, [[1]] * 4, [[]] * 4, [torch.Generator().manual_seed(i) for i in range(4)],
            eos_token_id=None, vocab_size=vocab, device="cpu")
        return Sampler(torch.Generator().manual_seed(0))(x, md).sampled_token_ids.tolist()
    tokens = sample(logits)
    assert tokens[1:] == [-1, -1, -1]
    assert tokens[0] == sample(clean)[0] >= 0


def test_a_nan_row_fails_only_its_request(inproc, runner, monkeypatch):
    """The attacker's row of logits is NaN (as a model's overflow would make it): its request
    fails with its own error; before, the argmax took the NaN and answered token 0."""
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


def test_a_seed_no_generator_takes_fails_only_its_request(inproc, runner, monkeypatch):
    """A seed past 64 bits that got by SamplingParams (here: set after its checks): before, the
    generator's overflow failed the whole step, the victim with it."""
    processor = inproc.engine.processor
    real = processor.make_requests

    def unchecked_seed(*args, **kwargs):
        requests = real(*args, **kwargs)
        for request in requests:
            if request.sampling_params.logprobs == MARK:
                request.sampling_params.seed = 2**64
        return requests
    monkeypatch.setattr(processor, "make_requests", unchecked_seed)
    with victim(inproc) as v:
        status, events = attack(inproc, logprobs=MARK, temperature=1.0, seed=1)
    messages = errors_of(status, events)
    assert messages and "seed" in messages[0], (status, events)
    assert_names_only_itself(events, messages)
    assert_clean(inproc, v)


def test_a_grammar_refusal_fails_only_its_request(inproc, runner, monkeypatch):
    """The attacker's sampled token is one its grammar forbids: before, accept_tokens raised
    and the whole step failed, the victim with an error naming the attacker's request."""
    real = runner.sampler

    def refused(logits, md):
        out = real(logits, md)
        if md.grammar_bitmask is not None:
            for row in md.grammar_rows:
                bits = (md.grammar_bitmask[row].cpu()[:, None] >> torch.arange(32)) & 1
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


def test_a_failed_step_names_no_other_request(inproc, runner, monkeypatch):
    """A whole step that raises (a bug) still fails every request in it, but a message that
    names one of them is not told to the others (the victim's id, which the error names, reaches
    the attacker as "another request"). Before, the attacker read the victim's id."""
    real, failed = runner.execute_model, []

    def fail_once(out):
        if len(out.requests) > 1 and not failed:       # the victim and the attacker
            failed.append(1)
            raise KeyError(next(r.request_id for r in out.requests if "-0" in r.request_id))
        return real(out)
    monkeypatch.setattr(runner, "execute_model", fail_once)
    with victim(inproc) as v:
        status, events = attack(inproc)
    theirs, own = errors_of(status, events), v.error["error"]["message"]
    assert failed and "KeyError" in own and theirs, (own, theirs)
    assert all("KeyError" in m and "another request" in m and "cmpl-" not in m for m in theirs)
    assert stream_text(inproc) == inproc.expected      # the engine goes on
    wait_idle(inproc)
