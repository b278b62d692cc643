"""The scheduler, driven by a fake model that reads tokens back through the block tables
(tests/fake_engine.py): same tokens whatever the pool, budget or policy; preemption,
chunked prefill, prefix hits, stop checks and admission errors."""

import json
import random

import pytest
from hypothesis import given, settings, strategies as st

from fake_engine import (FakeRunner, make_request, make_scheduler,
                         reference_tokens, run)
from nanoserve.sampling_params import SamplingParams
from nanoserve.request import Request, check_fits
from nanoserve.trace import Tracer


def workload(seed=0, n=12, shared_prefix=0):
    rng = random.Random(seed)
    prefix = [rng.randrange(50) for _ in range(shared_prefix)]
    return [(f"r{i}", prefix + [rng.randrange(50) for _ in range(rng.randint(1, 40))],
             rng.randint(1, 30)) for i in range(n)]


def run_workload(spec, **cfg):
    sched = make_scheduler(**cfg)
    outs, steps = run(sched, [make_request(*s) for s in spec],
                      check=lambda s: s.kv.check_invariants())
    assert sched.kv.pool.num_free_blocks == sched.kv.num_blocks   # nothing leaked
    return sched, outs, steps


@pytest.mark.parametrize("caching", [True, False])
def test_same_tokens_roomy_preempting_and_chunked(caching):
    spec = workload(shared_prefix=8)
    expected = {rid: reference_tokens(p, m) for rid, p, m in spec}

    _, roomy, _ = run_workload(spec, num_blocks=256, enable_prefix_caching=caching)
    assert roomy == expected

    tight, outs, _ = run_workload(spec, num_blocks=24, enable_prefix_caching=caching)
    assert tight.num_preemptions_total > 0          # the small pool did preempt
    assert outs == expected

    _, outs, steps = run_workload(spec, num_blocks=256, max_num_batched_tokens=16,
                                  enable_prefix_caching=caching)
    chunked = [s for s in steps for r, n, c in zip(s.requests, s.num_scheduled_tokens,
                                                   s.num_computed_tokens)
               if c + n < r.num_prompt_tokens]
    assert chunked                                  # some prompt was split over steps
    assert all(s.total_num_scheduled_tokens <= 16 for s in steps)
    assert outs == expected


def test_token_budget_seats_and_decode_batching():
    spec = [(f"r{i}", [i + 1] * 5, 6) for i in range(6)]
    _, outs, steps = run_workload(spec, max_num_seqs=4, max_num_batched_tokens=64)
    assert max(len(s.requests) for s in steps) == 4
    # Step 1 prefills four prompts together; later steps decode them in one batch.
    assert steps[0].num_scheduled_tokens == [5, 5, 5, 5]
    assert steps[1].num_scheduled_tokens == [1, 1, 1, 1]


def test_prefix_caching_computes_only_the_suffix():
    prefix = list(range(64))
    sched = make_scheduler(num_blocks=64, block_size=16)
    a = make_request("a", prefix + [1, 2, 3], 2)
    b = make_request("b", prefix + [7, 8, 9, 10, 11], 2)
    runner = FakeRunner(64, 16)
    run(sched, [a], runner=runner)
    _, steps = run(sched, [b], runner=runner)
    assert steps[0].num_computed_tokens == [64]      # 4 cached blocks of 16
    assert steps[0].num_scheduled_tokens == [5]      # only the new suffix is computed
    assert b.output_token_ids == reference_tokens(b.prompt_token_ids, 2)
    assert sched.kv.prefix_cache_queries == 67 + 69
    assert sched.kv.prefix_cache_hits == 64


def test_n_siblings_share_prompt_blocks_in_the_same_step():
    sched = make_scheduler(num_blocks=64, block_size=4)
    prompt = list(range(10))
    reqs = [make_request(f"s{i}", prompt, 3) for i in range(3)]
    _, steps = run(sched, reqs)
    first = steps[0]
    assert first.num_computed_tokens == [0, 8, 8]    # siblings hit the first's 2 full blocks
    assert first.block_tables[1][:2] == first.block_tables[0][:2]


def test_preemption_is_last_admitted_and_resumes_from_cache():
    tracer_events = []

    class ListTracer:
        enabled, step = True, 0

        def emit(self, ev, **f):
            tracer_events.append(dict(ev=ev, **f))

    sched = make_scheduler(num_blocks=6, block_size=4, tracer=ListTracer())
    reqs = [make_request("a", [1] * 8, 8), make_request("b", [2] * 8, 8)]
    outs, _ = run(sched, reqs)
    preempts = [e for e in tracer_events if e["ev"] == "preempt"]
    assert preempts and preempts[0]["req"] == "b"
    assert outs == {"a": reference_tokens([1] * 8, 8), "b": reference_tokens([2] * 8, 8)}
    assert any(e["ev"] == "prefix_hit" and e["req"] == "b" for e in tracer_events)


def test_priority_policy_admits_and_preempts_by_priority():
    sched = make_scheduler(num_blocks=6, block_size=4, scheduling_policy="priority")
    low = Request("low", [1] * 8, SamplingParams(max_tokens=8, ignore_eos=True), priority=5)
    high = Request("high", [2] * 8, SamplingParams(max_tokens=8, ignore_eos=True), priority=0)
    sched.add_request(low)
    sched.add_request(high)
    out = sched.schedule()
    assert [r.request_id for r in out.requests] == ["high", "low"]
    runner = FakeRunner(6, 4)
    sched.update(out, runner.execute(out))
    while sched.has_unfinished_requests():
        out = sched.schedule()
        if out.preempted_req_ids:
            assert out.preempted_req_ids == ["low"]
        sched.update(out, runner.execute(out))
        sched.kv.check_invariants()
    assert sched.num_preemptions_total > 0
    assert high.output_token_ids == reference_tokens([2] * 8, 8)
    assert low.output_token_ids == reference_tokens([1] * 8, 8)


def test_stop_conditions():
    sched = make_scheduler(num_blocks=64, max_model_len=20)
    prompt = [3, 4, 5]
    ref = reference_tokens(prompt, 10)
    eos = Request("eos", prompt, SamplingParams(max_tokens=10), eos_token_id=ref[2])
    ignore = Request("ignore", prompt, SamplingParams(max_tokens=10, ignore_eos=True),
                     eos_token_id=ref[2])
    stop_id = Request("stop_id", prompt, SamplingParams(max_tokens=10, stop_token_ids=[ref[1]]))
    min_tok = Request("min", prompt, SamplingParams(max_tokens=10, min_tokens=3),
                      eos_token_id=ref[0])
    capped = Request("cap", [1] * 15, SamplingParams(max_tokens=None, ignore_eos=True))
    run(sched, [eos, ignore, stop_id, min_tok, capped])
    assert (eos.output_token_ids, eos.finish_reason) == (ref[:3], "stop")
    assert (ignore.output_token_ids, ignore.finish_reason) == (ref, "length")
    assert (stop_id.output_token_ids, stop_id.stop_reason) == (ref[:2], ref[1])
    assert min_tok.num_output_tokens >= 3
    assert (capped.num_tokens, capped.finish_reason) == (20, "length")   # max_model_len


def test_impossible_requests_are_rejected_up_front():
    """check_fits (what Processor runs before anything reaches the engine) refuses them; the
    scheduler only asserts that it did."""
    sched = make_scheduler(num_blocks=4, block_size=4, max_model_len=64)
    with pytest.raises(ValueError, match="3 more than max_model_len"):
        check_fits(sched.config, 67, 1)
    with pytest.raises(ValueError, match="empty"):
        check_fits(sched.config, 0, 1)
    # 10 prompt + 10 output needs 19 slots; the pool holds 16.
    with pytest.raises(ValueError, match="3 more than the whole pool"):
        check_fits(sched.config, 10, 10)
    with pytest.raises(AssertionError, match="unchecked: .*3 more than the whole pool"):
        sched.add_request(make_request("big", [1] * 10, 10))
    check_fits(sched.config, 10, 6)
    sched.add_request(make_request("ok", [1] * 10, 6))
    with pytest.raises(ValueError, match="already in use"):
        sched.add_request(make_request("ok", [1], 1))


def test_abort_frees_everything():
    sched = make_scheduler(num_blocks=32)
    reqs = [make_request(f"r{i}", [i] * 9, 20) for i in range(3)]
    for r in reqs:
        sched.add_request(r)
    out = sched.schedule()
    sched.update(out, FakeRunner(32, 4).execute(out))
    aborted = sched.abort(["r0", "r2", "unknown"])
    assert [r.finish_reason for r in aborted] == ["abort", "abort"]
    sched.abort(["r1"])
    assert not sched.has_unfinished_requests() and not sched.running
    assert sched.kv.pool.num_free_blocks == 32
    sched.kv.check_invariants()


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_a_request_waiting_for_its_grammar_is_passed_over_and_keeps_its_place(policy):
    """vLLM's WAITING_FOR_FSM: the queue's head, still compiling its grammar, does not hold the
    requests behind it; once compiled it goes before the ones that arrived after it."""
    sched = make_scheduler(max_num_seqs=1, scheduling_policy=policy)
    reqs = [make_request(rid, [1, 2, 3], 2) for rid in ("grammar", "b", "c")]
    _, steps = run(sched, reqs, grammar_ready={"grammar": 1})
    assert [[r.request_id for r in out.requests] for out in steps] == [
        ["b"], ["b"], ["grammar"], ["grammar"], ["c"], ["c"]]


def test_trace_replays_kv_used_and_ends_empty(tmp_path):
    path = tmp_path / "t.jsonl"
    tracer = Tracer(str(path))
    sched = make_scheduler(num_blocks=20, tracer=tracer)
    run(sched, [make_request(*s) for s in workload(seed=1, shared_prefix=12)])
    tracer.close()
    events = [json.loads(line) for line in path.read_text().splitlines()]
    assert {"arrive", "alloc", "prefix_hit", "free", "preempt", "schedule", "finish",
            "evict"} <= {e["ev"] for e in events}
    counts: dict[int, int] = {}
    for e in events:
        if e["ev"] in ("alloc", "prefix_hit"):
            for b in e["blocks"]:
                counts[b] = counts.get(b, 0) + 1
        elif e["ev"] == "free":
            for b in e["blocks"]:
                counts[b] -= 1
        elif e["ev"] == "schedule":
            assert sum(1 for c in counts.values() if c > 0) == e["kv_used"]
            assert e["kv_used"] + e["kv_free"] == 20
    assert all(c == 0 for c in counts.values())
    steps = [e["step"] for e in events]
    assert steps == sorted(steps)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10**6), num_blocks=st.integers(12, 60),
       budget=st.integers(4, 64), seqs=st.integers(1, 8), caching=st.booleans(),
       policy=st.sampled_from(["fcfs", "priority"]), block_size=st.sampled_from([2, 4, 8]))
def test_random_workloads_match_reference(seed, num_blocks, budget, seqs, caching, policy,
                                          block_size):
    rng = random.Random(seed)
    spec = workload(seed, n=rng.randint(1, 10), shared_prefix=rng.choice([0, 5, 16]))
    sched = make_scheduler(num_blocks=num_blocks, block_size=block_size, max_num_seqs=seqs,
                           max_num_batched_tokens=budget, enable_prefix_caching=caching,
                           scheduling_policy=policy)
    reqs, grammar_ready = [], {}
    for rid, prompt, m in spec:
        if rng.random() < 0.3:           # its grammar compiles for a while (WAITING_FOR_FSM)
            grammar_ready[rid] = rng.randint(0, 20)
        r = Request(rid, prompt, SamplingParams(max_tokens=m, ignore_eos=True),
                    priority=rng.randint(0, 3))
        try:
            check_fits(sched.config, len(prompt), m)
        except ValueError:
            continue
        reqs.append(r)
    outs, _ = run(sched, reqs, check=lambda s: s.kv.check_invariants(),
                  grammar_ready=grammar_ready)
    assert outs == {r.request_id: reference_tokens(r.prompt_token_ids, r.sampling_params.max_tokens)
                    for r in reqs}
    assert sched.kv.pool.num_free_blocks == num_blocks
