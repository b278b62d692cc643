"""Speculative decoding (n-gram proposer, nanoserve/spec_decode.py) against its oracles:

- greedy with speculation == HF `generate` (greedy without it), token for token, on Llama, Qwen2
  and Qwen3 checkpoints: alone, batched, chunked, under preemption, with prefix-cache hits; the
  KV invariants checked after every step (`debug=2`), and no block hashed past accepted tokens;
- sampled: the first token's distribution with drafts == the target's (chi-square at a fixed
  seed), and the same test rejects a wrong acceptance rule;
- stops cut inside an accepted run; aborts leak no block; the proposer and the config.

    pytest -q tests/test_spec_decode.py
"""

import random

import pytest
import torch

from nanoserve import LLM, SamplingParams
from nanoserve import spec_decode
from nanoserve.config import Config
from nanoserve.spec_decode import NgramProposer, accepted_tokens, verification_rows

import fake_engine
from test_llm import GREEDY, hf_greedy

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
        "prompt_lookup_max": 3}


# -- the proposer and the rule ---------------------------------------------------------------
def test_proposer_prefers_the_longest_then_the_most_recent_match():
    p = NgramProposer(num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=3)
    # [8, 9] ends the sequence: the 2-token match at 0 beats the more recent 1-token one at 5.
    assert p.propose([8, 9, 1, 2, 3, 9, 4, 8, 9], max_drafts=3) == [1, 2, 3]
    # Two 3-token matches: the most recent one's continuation.
    assert p.propose([1, 2, 3, 4, 1, 2, 3, 5, 1, 2, 3], max_drafts=3) == [5, 1, 2]
    assert p.propose([1, 2, 3, 4, 1, 2, 3], max_drafts=2) == [4, 1]       # capped by room
    assert p.propose([5, 6, 5], max_drafts=3) == [6, 5]                   # fewer left to copy
    assert p.propose([1, 2, 3], max_drafts=3) == []                       # no match
    assert NgramProposer(3, 2, 3).propose([7, 1, 2, 7], max_drafts=3) == []   # below min


def test_accepted_tokens_and_rows():
    assert accepted_tokens([5, 6, 7], [5, 6, 7, 8]) == [5, 6, 7, 8]       # all kept + bonus
    assert accepted_tokens([5, 6, 7], [4, 6, 7, 8]) == [4]                # first differs
    assert accepted_tokens([], [3]) == [3]

    class R:
        def __init__(self, rid):
            self.request_id, self.output_token_ids = rid, [9]
    a, b = R("a"), R("b")
    rows = verification_rows([a, b], {"b": [1, 2]})
    assert [(r.request_id, out) for r, out in rows] == [
        ("a", [9]), ("b", [9]), ("b", [9, 1]), ("b", [9, 1, 2])]


def test_config_names_the_bad_key_or_value():
    c = Config(speculative_config='{"method": "ngram", "num_speculative_tokens": 3}')
    assert (c.speculative_config.prompt_lookup_min, c.speculative_config.prompt_lookup_max) == (5, 5)
    for bad, word in [({"method": "eagle", "num_speculative_tokens": 1}, "method"),
                      ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
                      ({"method": "ngram", "num_speculative_tokens": 2, "draft": 1}, "'draft'"),
                      ({"method": "ngram"}, "num_speculative_tokens"),
                      ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4,
                        "prompt_lookup_max": 2}, "prompt_lookup_min"),
                      ("{not json", "JSON")]:
        with pytest.raises(ValueError, match=word):
            Config(speculative_config=bad)


# -- greedy: equal to the oracle in every regime ---------------------------------------------
def copy_workload(seed, n, vocab=384):
    """Random prompts that end by repeating their start, so the proposer finds matches."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(n):
        body = [rng.randrange(1, vocab) for _ in range(rng.randint(8, 60))]
        prompts.append(body + body[:rng.randint(2, 6)])
    return prompts, [rng.randint(30, 60) for _ in prompts]


def check_hashed_blocks(llm):
    """Every hashed block of a running request is full of its accepted tokens."""
    kv, bs = llm.engine.kv_cache_manager, llm.engine.config.block_size
    for request in llm.engine.scheduler.running:
        hashes = kv.block_hashes(request)
        for i, block_id in enumerate(kv.req_to_block_ids.get(request.request_id, [])):
            block = kv.pool.blocks[block_id]
            if block.block_hash is not None and block.ref_cnt == 1:
                assert (i + 1) * bs <= request.num_computed_tokens, (request, i)
                assert block.block_hash == hashes[i], (request, i)


def run_checked(llm, prompts, max_tokens, **params):
    """generate() stepped by hand, checking the hashed blocks after every step (debug=2 checks
    the KV invariants inside each step)."""
    step = llm.engine.step

    def checked_step():
        outputs = step()
        check_hashed_blocks(llm)
        return outputs
    llm.engine.step = checked_step
    try:
        return llm.generate([{"prompt_token_ids": p} for p in prompts],
                            [SamplingParams(max_tokens=m, **(params or GREEDY)) for m in max_tokens],
                            progress=False)
    finally:
        del llm.engine.step


@pytest.mark.parametrize("setup", ["alone", "batched", "chunked", "preempt", "prefix_hits"])
def test_greedy_with_speculation_equals_hf(checkpoint, setup):
    path, model = checkpoint
    kwargs = {"chunked": dict(max_num_batched_tokens=24),
              "preempt": dict(num_kv_blocks=16, max_num_seqs=8)}.get(setup, {})
    llm = LLM(path, block_size=16, max_model_len=256, debug=2, speculative_config=SPEC,
              **{"num_kv_blocks": 256, **kwargs})
    prompts, max_tokens = copy_workload(seed=3, n=1 if setup == "alone" else 8)
    if setup == "preempt":   # 8 prompts of 3 blocks that grow to 4: 16 blocks cannot hold them
        prompts, max_tokens = [(p * 8)[:40] for p in prompts], [24] * 8
    rounds = 2 if setup == "prefix_hits" else 1   # round 2 hits the blocks round 1 cached
    for _ in range(rounds):
        outs = run_checked(llm, prompts, max_tokens)
        for p, m, out in zip(prompts, max_tokens, outs):
            assert out.outputs[0].token_ids == hf_greedy(model, p, m), f"prompt of {len(p)} tokens"
    stats, pool = llm.engine.get_stats(), llm.engine.kv_cache_manager.pool
    assert stats["spec_decode_num_draft_tokens_total"] > 0
    assert pool.num_free_blocks == pool.num_blocks                    # nothing leaked
    if setup == "preempt":
        assert llm.engine.scheduler.num_preemptions_total > 0
    if setup == "prefix_hits":
        assert llm.engine.kv_cache_manager.prefix_cache_hits > 0


def test_drafts_are_accepted_and_counted_per_position():
    """On a prompt that holds the built-in model's own story (it copies it), most drafts are
    kept: 60 tokens in far fewer than the 61 steps they take one at a time."""
    llm = LLM("nanoserve-tiny", max_model_len=512, debug=2, speculative_config=SPEC)
    plain = LLM("nanoserve-tiny", max_model_len=512)
    story = plain.generate("Once upon a time", SamplingParams(max_tokens=100, **GREEDY),
                           progress=False)[0]
    prompt = story.prompt_token_ids + story.outputs[0].token_ids + story.prompt_token_ids
    want, got = (e.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=60, **GREEDY),
                            progress=False)[0].outputs[0].token_ids for e in (plain, llm))
    assert got == want
    stats = llm.engine.get_stats()
    per_pos = stats["spec_decode_num_accepted_tokens_per_pos_total"]
    assert sum(per_pos) == stats["spec_decode_num_accepted_tokens_total"]
    assert per_pos == sorted(per_pos, reverse=True)     # position j needs j - 1 kept before it
    assert stats["spec_decode_num_accepted_tokens_total"] > stats["spec_decode_num_drafts_total"]
    assert llm.engine.scheduler.num_steps <= 40


def test_stops_cut_inside_an_accepted_run():
    """EOS-like stop ids, max_tokens and stop strings end a run where the plain engine ends."""
    llm = LLM("nanoserve-tiny", max_model_len=512, speculative_config=SPEC)
    plain = LLM("nanoserve-tiny", max_model_len=512)
    story = plain.generate("Once upon a time", SamplingParams(max_tokens=60, **GREEDY),
                           progress=False)[0]
    prompt = story.prompt + story.outputs[0].text + " Once upon a time"
    ids = plain.generate(prompt, SamplingParams(max_tokens=30, **GREEDY), progress=False)[0]
    words = ids.outputs[0].text.split()
    for params in [dict(stop_token_ids=[ids.outputs[0].token_ids[12]]), dict(max_tokens=7),
                   dict(stop=[" ".join(words[3:5])])]:
        p = SamplingParams(**{"max_tokens": 30, **GREEDY, **params})
        a, b = (e.generate(prompt, p, progress=False)[0].outputs[0] for e in (plain, llm))
        assert (b.token_ids, b.text, b.finish_reason) == (a.token_ids, a.text, a.finish_reason)
    assert llm.engine.get_stats()["spec_decode_num_accepted_tokens_total"] > 0


def test_aborts_leak_no_block():
    llm = LLM("nanoserve-tiny", max_model_len=512, debug=2, speculative_config=SPEC)
    prompt = llm.tokenizer.encode("the cat sat on the mat. the cat sat on the mat. the cat")
    for i in range(4):
        llm._add(f"r{i}", llm.processor.make_requests(
            f"r{i}", prompt, SamplingParams(max_tokens=100, **GREEDY)))
    for _ in range(6):
        llm.engine.step()
    assert llm.engine.get_stats()["spec_decode_num_drafts_total"] > 0
    llm.engine.abort([f"r{i}" for i in range(4)])
    kv = llm.engine.kv_cache_manager
    kv.check_invariants()
    assert kv.pool.num_free_blocks == kv.pool.num_blocks


# -- sampled: the output distribution is the target's -----------------------------------------
VOCAB, TEMPERATURE, RUNS = 16, 2.0, 3000


@pytest.fixture(scope="module")
def tiny_vocab(tmp_path_factory):
    from conftest import build_checkpoint
    path = tmp_path_factory.mktemp("tiny_vocab")
    build_checkpoint(path, "llama", vocab_size=VOCAB)
    return str(path)


def chi_square(counts, probs):
    """(statistic, p-value) of counts against probs (cells expected >= 5; the rest pooled)."""
    n = sum(counts)
    cells, rest = [], [0, 0.0]
    for c, q in zip(counts, probs):
        if q * n >= 5:
            cells.append((c, q * n))
        else:
            rest[0], rest[1] = rest[0] + c, rest[1] + q * n
    if rest[1] > 0:
        cells.append(tuple(rest))
    stat = sum((c - e) ** 2 / e for c, e in cells)
    dof = len(cells) - 1
    return stat, torch.special.gammaincc(torch.tensor(dof / 2), torch.tensor(stat / 2)).item()


def first_token_counts(path, prompt):
    llm = LLM(path, skip_tokenizer_init=True, max_num_seqs=256, max_num_batched_tokens=4096,
              speculative_config=SPEC)
    params = [SamplingParams(temperature=TEMPERATURE, seed=s, max_tokens=3, ignore_eos=True)
              for s in range(RUNS)]
    outs = llm.generate([{"prompt_token_ids": prompt}] * RUNS, params, progress=False)
    # Every run verified drafts in its first step (the prompt's own match), so its first token
    # went through the acceptance rule.
    assert llm.engine.get_stats()["spec_decode_num_drafts_total"] >= RUNS
    counts = [0] * VOCAB
    for out in outs:
        counts[out.outputs[0].token_ids[0]] += 1
    return counts


def draft_prompt(path):
    """(prompt, the target's first-token distribution, the draft): the prompt among
    [1, 2, 3, d, 9, 5, 1, 2, 3] whose draft d has the most middling probability, so that the
    accept and the reject branch both happen often. The distribution: softmax(raw logprobs /
    temperature), from the engine without speculation."""
    llm = LLM(path, skip_tokenizer_init=True, max_logprobs=VOCAB)
    prompts = [[1, 2, 3, d, 9, 5, 1, 2, 3] for d in range(1, VOCAB)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=1, logprobs=VOCAB),
                        progress=False)
    candidates = []
    for prompt, out in zip(prompts, outs):
        logprobs = torch.tensor([out.outputs[0].logprobs[0][t].logprob for t in range(VOCAB)])
        probs = (logprobs / TEMPERATURE).softmax(-1).tolist()
        candidates.append((abs(probs[prompt[3]] - 0.4), prompt, probs, prompt[3]))
    return min(candidates)[1:]


def wrong_rule_accept_all(drafts, targets):
    return list(drafts) + [targets[len(drafts)]]


def wrong_rule_lenient(drafts, targets):
    """Keeps a draft that equals the target's token at its position or at the next one."""
    n = 0
    while n < len(drafts) and drafts[n] in targets[n:n + 2]:
        n += 1
    return list(drafts[:n]) + [targets[n]]


@pytest.mark.parametrize("rule", [None, wrong_rule_accept_all, wrong_rule_lenient])
def test_first_token_distribution_is_the_target(tiny_vocab, monkeypatch, rule):
    """The right rule passes (p-value well above 0.001); a wrong one fails the same test."""
    prompt, probs, draft = draft_prompt(tiny_vocab)
    assert 0.05 < probs[draft] < 0.95, probs
    if rule is not None:
        monkeypatch.setattr(spec_decode, "accepted_tokens", rule)
    stat, p_value = chi_square(first_token_counts(tiny_vocab, prompt), probs)
    print(f"rule {getattr(rule, '__name__', 'accepted_tokens')}: p(draft) {probs[draft]:.3f}, "
          f"chi-square {stat:.1f}, p-value {p_value:.3g}")
    assert (p_value > 1e-3) == (rule is None), (stat, p_value)


def test_seeded_runs_repeat_with_speculation(tiny_vocab):
    llm = LLM(tiny_vocab, skip_tokenizer_init=True, speculative_config=SPEC)
    prompt = {"prompt_token_ids": [1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2, 3]}
    params = SamplingParams(temperature=1.0, seed=7, max_tokens=30, ignore_eos=True)
    first, again = (llm.generate(prompt, params, progress=False)[0].outputs[0].token_ids
                    for _ in range(2))
    assert first == again


# -- model-free: the scheduler and the KV manager under speculation ---------------------------
def copying_model(seq):
    """A fake model that mostly repeats itself (period 5) but not always: drafts are often
    kept whole, often cut short."""
    return seq[-5] if len(seq) >= 5 and len(seq) % 7 else (seq[-1] * 3 + 1) % fake_engine.VOCAB


@pytest.mark.parametrize("seed", range(4))
def test_scheduler_with_drafts_equals_the_reference(monkeypatch, seed):
    """Small pools (preemption), small budgets (chunks, drafts cut by the budget), prefix hits:
    outputs equal the fake model's reference, invariants and hashed blocks hold every step."""
    monkeypatch.setattr(fake_engine, "next_token", copying_model)
    rng = random.Random(seed)
    prefix = [rng.randrange(50) for _ in range(9)]
    specs = [(f"r{i}", prefix + [rng.randrange(50) for _ in range(rng.randint(1, 20))],
              rng.randint(1, 40)) for i in range(10)]
    sched = fake_engine.make_scheduler(num_blocks=rng.choice([20, 40]), block_size=4,
                                       max_num_batched_tokens=rng.choice([8, 16, 64]),
                                       speculative_config={**SPEC, "num_speculative_tokens":
                                                           rng.choice([1, 3, 6])})

    def check(s):
        s.kv.check_invariants()
        for request in s.running:
            for i, block_id in enumerate(s.kv.req_to_block_ids[request.request_id]):
                block = s.kv.pool.blocks[block_id]
                if block.block_hash is not None and block.ref_cnt == 1:
                    assert (i + 1) * 4 <= request.num_computed_tokens
                    assert block.block_hash == s.kv.block_hashes(request)[i]
    outputs, _ = fake_engine.run(sched, [fake_engine.make_request(*s) for s in specs], check)
    for rid, prompt, max_tokens in specs:
        assert outputs[rid] == fake_engine.reference_tokens(prompt, max_tokens), rid
    assert sched.spec_counts["num_accepted_tokens"] > 0
    assert sched.spec_counts["num_accepted_tokens"] < sched.spec_counts["num_draft_tokens"]
    assert sched.kv.pool.num_free_blocks == sched.kv.pool.num_blocks


def test_trace_replay_with_drafts_equals_the_live_state(monkeypatch, tmp_path):
    """`nanoserve trace` rebuilds the run from the trace alone, drafts and rollbacks included."""
    from test_replay import traced_run
    from nanoserve.trace import Trace, load_events
    monkeypatch.setattr(fake_engine, "next_token", copying_model)
    sched, truth = traced_run(tmp_path / "t.jsonl", speculative_config=SPEC)
    trace = Trace.load(str(tmp_path / "t.jsonl"))
    assert sched.spec_counts["num_accepted_tokens"] > 0
    for step, (owners, cached, sampled) in truth.items():
        frame = trace.frame(step)
        assert {b: set(h) for b, h in frame.holders.items()} == owners, step
        assert frame.cached == cached, step
        assert {r.req for r in trace.requests.values() if step in r.token_steps} == sampled, step
    output_lens = {e["req"]: e["output_len"] for e in load_events(str(tmp_path / "t.jsonl"))
                   if e["ev"] == "finish"}
    for r in trace.requests.values():     # one token time per token, drafts included
        assert len(r.token_steps) == output_lens[r.req], r.req
    assert sum(f.spec[1] for f in trace.frames.values() if f.spec) == \
        sched.spec_counts["num_accepted_tokens"]


def test_metrics_name_the_counters_as_vllm_does():
    """/metrics: the per-position counter is one sample per engine and position, labelled
    `engine` and `position`; the summed stats add the ranks position by position."""
    from types import SimpleNamespace

    from prometheus_client import CollectorRegistry, generate_latest

    from nanoserve.api import OpenAIServer
    from nanoserve.engine import sum_over_ranks
    ranks = [{"spec_decode_num_drafts_total": 3, "spec_decode_num_draft_tokens_total": 12,
              "spec_decode_num_accepted_tokens_total": 7,
              "spec_decode_num_accepted_tokens_per_pos_total": [3, 2, 1, 1]},
             {"spec_decode_num_drafts_total": 1, "spec_decode_num_draft_tokens_total": 4,
              "spec_decode_num_accepted_tokens_total": 1,
              "spec_decode_num_accepted_tokens_per_pos_total": [1, 0, 0, 0]}]
    summed = {name: sum_over_ranks([r[name] for r in ranks])
              for name in ranks[0]}
    assert summed["spec_decode_num_accepted_tokens_per_pos_total"] == [4, 2, 1, 1]
    server = SimpleNamespace(engine=SimpleNamespace(get_stats=lambda: summed, engine_stats=ranks))

    class Collector:
        def collect(self):
            return OpenAIServer.collect(server)
    registry = CollectorRegistry()
    registry.register(Collector())
    text = generate_latest(registry).decode()
    assert 'nanoserve:spec_decode_num_draft_tokens_total{engine="0"} 12.0' in text
    assert ('nanoserve:spec_decode_num_accepted_tokens_per_pos_total{engine="1",position="0"} 1.0'
            in text)
    assert ('nanoserve:spec_decode_num_accepted_tokens_per_pos_total{engine="0",position="1"} 2.0'
            in text)


def test_disable_by_batch_size_drafts_only_for_small_batches():
    """`disable_by_batch_size` (vLLM V0's key): no drafts while more requests than it are in the engine."""
    num_drafts = []
    for limit, num_requests in ((2, 4), (4, 4)):
        sched = fake_engine.make_scheduler(speculative_config={**SPEC, "disable_by_batch_size": limit})
        prompt = [1, 2, 3, 1, 2, 3, 1, 2]
        fake_engine.run(sched, [fake_engine.make_request(f"r{i}", prompt, 12)
                                for i in range(num_requests)])
        num_drafts.append(sched.spec_counts["num_drafts"])
    assert num_drafts[0] == 0 and num_drafts[1] > 0
    with pytest.raises(ValueError, match="disable_by_batch_size"):
        Config(speculative_config={**SPEC, "disable_by_batch_size": 0})
