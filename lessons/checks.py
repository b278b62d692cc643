"""checks.py: the checks behind `nanoserve exercise`, for the lessons' build exercises.

    nanoserve exercise list                    # every build exercise and its file
    nanoserve exercise check 3.3               # your file, lessons/exercises/lesson3_....py
    nanoserve exercise check 3.3 --solution    # the reference, lessons/solutions/lesson3_....py

Every check is an oracle: the same input goes through your code and through nanoserve (or a
brute-force reference), and the answers must agree. The scheduler and KV cache exercises run
on tests/fake_engine.py, a model-free engine whose "model" stores every token through the
block tables and reads it back, so a wrong schedule or a wrongly shared block shows up as a
wrong output token. CI runs every check against the solutions (tests/test_lessons.py), which
proves each check can pass; the untouched starters must fail, saying what to implement.
"""

from __future__ import annotations

import importlib.util
import random
import sys
import traceback
from pathlib import Path
from typing import Callable, NamedTuple

LESSONS = Path(__file__).resolve().parent


def load(path: Path):
    """Import a Python file by its path (exercise files need not be on sys.path)."""
    name = f"_lesson_{path.parent.name}_{path.stem}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = sys.modules[name] = importlib.util.module_from_spec(spec)   # (dataclasses need it)
    spec.loader.exec_module(module)
    return module


def fake_engine():
    return load(LESSONS.parent / "tests" / "fake_engine.py")


def expect(ok: bool, message: str) -> None:
    if not ok:
        raise AssertionError(message)


# -- 1.3 the engine loop ---------------------------------------------------------------------
def check_engine_loop(mod, say) -> None:
    from nanoserve import LLM, SamplingParams
    llm = LLM(block_size=8, num_kv_blocks=64, max_model_len=128)
    prompts = [llm.tokenizer.encode(t) for t in
               ("Once upon a time", "The cat sat on the mat", "Tom and Lily went to the park")]
    got = mod.generate(llm.engine, prompts, 12)
    pool = llm.engine.kv_cache_manager.pool
    expect(not llm.engine.has_unfinished_requests() and pool.num_free_blocks == pool.num_blocks,
           "after generate() the engine must be idle with every block free: step until "
           "core.has_unfinished_requests() is False")
    want = [o.outputs[0].token_ids for o in llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), progress=False)]
    expect(got == want, f"your tokens differ from LLM.generate's:\n  yours: {got}\n  LLM:   {want}")
    say("3 prompts, 12 tokens each: token for token the same as LLM.generate; every block freed")


# -- 2.3 paged decode attention ------------------------------------------------------------------
def check_paged_decode(mod, say) -> None:
    import torch

    from nanoserve.paged_attention import AttentionMetadata, paged_attention_torch, store_kv_torch
    gen = torch.Generator().manual_seed(0)
    num_blocks, block_size, heads, kv_heads, dim = 16, 4, 4, 2, 8
    for seq_len in (1, 4, 5, 13):
        # Garbage everywhere: a correct read never looks past the request's own seq_len slots.
        k_cache = torch.full((num_blocks, block_size, kv_heads, dim), 1e4)
        v_cache = torch.full((num_blocks, block_size, kv_heads, dim), 1e4)
        table = torch.randperm(num_blocks, generator=gen)[:-(-seq_len // block_size)].tolist()
        k, v = (torch.randn(seq_len, kv_heads, dim, generator=gen) for _ in range(2))
        pos = torch.arange(seq_len)
        slots = torch.tensor(table)[pos // block_size] * block_size + pos % block_size
        store_kv_torch(k, v, k_cache, v_cache, slots)
        query = torch.randn(heads, dim, generator=gen)
        got = mod.paged_decode_attention(query, k_cache, v_cache, list(table), seq_len, dim ** -0.5)
        expect(tuple(got.shape) == (heads, dim), f"the output must be [num_heads, head_dim] = "
               f"[{heads}, {dim}] (got {list(got.shape)})")
        dense = torch.nn.functional.scaled_dot_product_attention(
            query[:, None], k.transpose(0, 1).repeat_interleave(2, 0),
            v.transpose(0, 1).repeat_interleave(2, 0))[:, 0]
        meta = AttentionMetadata(slots[-1:], torch.tensor([table], dtype=torch.int32),
                                 torch.tensor([seq_len], dtype=torch.int32),
                                 torch.tensor([0, 1], dtype=torch.int32), 1, seq_len)
        paged = paged_attention_torch(query[None], k_cache, v_cache, meta, dim ** -0.5)[0]
        expect(torch.allclose(dense, paged, atol=1e-5), "the oracles disagree (a bug in the check)")
        expect(torch.allclose(got, dense, atol=1e-4),
               f"seq_len {seq_len}, block_table {table}: your output differs from dense attention "
               f"by {(got - dense).abs().max():.3g} (read only the first seq_len slots, in "
               f"block-table order; each KV head serves {heads // kv_heads} query heads)")
    say("seq_len 1, 4, 5, 13 over shuffled block tables, GQA 4:2: equal to dense SDPA and to "
        "nanoserve's paged_attention_torch")


# -- 3.3 shortest job first; 3.4 static batching ------------------------------------------------
def scheduler_of(cls, num_blocks=128, block_size=4, max_model_len=128, **config):
    from nanoserve.config import Config
    from nanoserve.kv_cache import KVCacheManager
    cfg = Config(block_size=block_size, max_model_len=max_model_len, num_kv_blocks=num_blocks,
                 **config)
    return cls(cfg, KVCacheManager(num_blocks, block_size, cfg.enable_prefix_caching))


def run_checked(fake, sched, spec):
    """Run (id, prompt, max_tokens) requests on the fake engine; the outputs must be the
    reference tokens and the KV invariants must hold after every step."""
    requests = [fake.make_request(*s) for s in spec]
    outs, steps = fake.run(sched, requests, check=lambda s: s.kv.check_invariants())
    for rid, prompt, max_tokens in spec:
        expect(outs[rid] == fake.reference_tokens(prompt, max_tokens),
               f"request {rid} produced the wrong tokens: a block was shared, freed or reused "
               "wrongly")
    expect(sched.kv.pool.num_free_blocks == sched.kv.num_blocks,
           "blocks leaked: not all free at the end")
    return requests, steps


def first_and_last_steps(steps) -> tuple[dict[str, int], dict[str, int]]:
    first, last = {}, {}
    for i, out in enumerate(steps, 1):
        for r in out.requests:
            first.setdefault(r.request_id, i)
            last[r.request_id] = i
    return first, last


def check_shortest_job_first(mod, say) -> None:
    from nanoserve.scheduler import Scheduler
    fake = fake_engine()
    # (id, prompt, max_tokens): job sizes 30, 9, 22, 5, 14, 40, all waiting at step 1
    spec = [(f"r{i}", [i + 1] * p, m) for i, (p, m) in
            enumerate([(10, 20), (3, 6), (12, 10), (2, 3), (6, 8), (15, 25)])]
    order = sorted(spec, key=lambda s: len(s[1]) + s[2])
    mean = {}
    for name, make_queue in (("FCFS", None), ("SJF", mod.ShortestJobFirstQueue)):
        sched = scheduler_of(Scheduler, max_num_seqs=1)
        if make_queue:
            sched.waiting = make_queue()
        _, steps = run_checked(fake, sched, spec)
        first, last = first_and_last_steps(steps)
        mean[name] = sum(last.values()) / len(last)
    admitted = sorted(first, key=first.get)
    expect(admitted == [s[0] for s in order], f"one seat (max_num_seqs 1): requests must run "
           f"shortest first, {[s[0] for s in order]} (got {admitted})")
    say(f"one seat: admitted shortest first {admitted}; mean finish step SJF {mean['SJF']:.1f} "
        f"vs FCFS {mean['FCFS']:.1f}")
    expect(mean["SJF"] < mean["FCFS"], "SJF must finish requests sooner on average than FCFS")
    # A pool so small that requests are preempted and re-queued with add(front=True).
    sched = scheduler_of(Scheduler, num_blocks=12)
    sched.waiting = mod.ShortestJobFirstQueue()
    run_checked(fake, sched, spec)
    expect(sched.num_preemptions_total > 0, "the small pool should have preempted (check bug)")
    say(f"12 blocks: {sched.num_preemptions_total} preemptions re-queued, every token right")
    sched = scheduler_of(Scheduler)
    sched.waiting = mod.ShortestJobFirstQueue()
    for s in spec:
        sched.add_request(fake.make_request(*s))
    sched.abort(["r2"])
    expect(len(sched.waiting) == 5 and all(r.request_id != "r2" for r in sched.waiting),
           "an aborted waiting request must leave the queue (remove)")
    say("abort removes a waiting request")


def check_static_batching(mod, say) -> None:
    from nanoserve.scheduler import Scheduler
    fake = fake_engine()
    spec = [(f"r{i}", [i + 1] * 6, 4 if i % 2 else 32) for i in range(8)]
    continuous = scheduler_of(Scheduler, max_num_seqs=4)
    _, cont_steps = run_checked(fake, continuous, spec)
    static = scheduler_of(mod.StaticBatchScheduler, max_num_seqs=4)
    _, steps = run_checked(fake, static, spec)
    first, last = first_and_last_steps(steps)
    for a in first:
        for b in first:
            expect(not first[a] < first[b] <= last[a],
                   f"{b} joined at step {first[b]} while {a} (admitted at step {first[a]}) was "
                   f"still running: a static batch admits nobody until it has finished")
    expect(len(set(first.values())) > 1, "no request waited: every request ran in one batch?")
    say(f"no request joins a running batch; {len(set(first.values()))} batches")
    expect(len(steps) > len(cont_steps), "static batching should need more steps than continuous")
    say(f"8 requests of 4 or 32 tokens, 4 seats: {len(steps)} steps static vs "
        f"{len(cont_steps)} continuous")


# -- 4.3 cheapest victim -----------------------------------------------------------------------
def check_cheapest_victim(mod, say) -> None:
    from nanoserve.scheduler import Scheduler
    fake = fake_engine()
    # Short prompts admitted first, long ones last: the default victim is the costly one.
    spec = [(f"r{i}", [i + 1] * p, m) for i, (p, m) in
            enumerate([(2, 24), (3, 24), (2, 24), (30, 8), (28, 8)])]
    computed = {}
    for name, cls in (("last admitted", Scheduler), ("cheapest", mod.CheapestVictimScheduler)):
        sched = scheduler_of(cls, num_blocks=14)
        not_last = 0
        pick = sched._pick_victim

        def checked():
            nonlocal not_last
            victim = pick()
            least = min(r.num_computed_tokens for r in sched.running)
            expect(victim in sched.running and victim.num_computed_tokens == least,
                   f"victim {victim.request_id} has {victim.num_computed_tokens} computed "
                   f"tokens; a running request has only {least}")
            not_last += victim is not sched.running[-1]
            return victim
        if cls is not Scheduler:
            sched._pick_victim = checked
        _, steps = run_checked(fake, sched, spec)
        computed[name] = sum(out.total_num_scheduled_tokens for out in steps)
    expect(not_last > 0, "every victim was the last admitted: pick by num_computed_tokens")
    say(f"14 blocks: every victim had the fewest computed tokens ({not_last} of them not the "
        f"last admitted); every token right")
    say(f"tokens computed in all, recomputation included: {computed['last admitted']} (last "
        f"admitted) vs {computed['cheapest']} (cheapest)")


# -- 5.3 hit-count eviction --------------------------------------------------------------------
def contract(pool) -> None:
    """Wrap pool.get_new_blocks: every block it hands out is held once, out of the free queue,
    and no longer in the prefix cache (a stale hash would serve new content as an old prefix)."""
    get_new_blocks = pool.get_new_blocks

    def checked(n: int):
        blocks = get_new_blocks(n)
        expect(len(blocks) == n, f"get_new_blocks({n}) returned {len(blocks)} blocks")
        for b in blocks:
            expect(b.ref_cnt == 1 and b.block_id not in pool.free_queue,
                   f"block {b.block_id}: a new block has ref_cnt 1 and leaves the free queue")
            expect(b.block_hash is None and b not in pool.cached_blocks.values(),
                   f"block {b.block_id} was evicted but keeps its hash: call self.uncache(block)")
        return blocks
    pool.get_new_blocks = checked


def check_hit_count_eviction(mod, say) -> None:
    from nanoserve.scheduler import Scheduler
    fake = fake_engine()
    hot = [7] * 8                                     # two blocks every hot request shares
    spec = ([(f"hot{i}", hot + [i + 1] * 3, 2) for i in range(2)]
            + [(f"cold{i}", [10 + i] * 20, 2) for i in range(6)] + [("hot2", hot + [9] * 3, 2)])
    hits: dict[str, dict[str, int]] = {}
    for name, pool in (("LRU", None), ("hit count", mod.HitCountBlockPool)):
        sched = scheduler_of(Scheduler, num_blocks=12)
        if pool:
            sched.kv.pool = pool(12, True)
            contract(sched.kv.pool)
        runner, hits[name] = fake.FakeRunner(12, 4), {}
        for rid, prompt, max_tokens in spec:          # one after another: the cache must remember
            before = sched.kv.prefix_cache_hits
            outs, _ = fake.run(sched, [fake.make_request(rid, prompt, max_tokens)],
                               check=lambda s: s.kv.check_invariants(), runner=runner)
            expect(outs[rid] == fake.reference_tokens(prompt, max_tokens),
                   f"{rid} produced the wrong tokens: it was served a block whose content changed")
            hits[name][rid] = sched.kv.prefix_cache_hits - before
    expect(hits["LRU"]["hot2"] == 0, "LRU should have evicted the hot prefix (check bug)")
    expect(hits["hit count"]["hot2"] == 8, f"hot2 hit {hits['hit count']['hot2']} tokens: the "
           "hot prefix (8 tokens, hit once before) must outlive six one-off prompts never hit")
    say("a hot prefix survives six one-off prompts: hot2 hits 8 tokens (LRU: 0); evicted "
        "blocks lose their hash")
    sched = scheduler_of(Scheduler, num_blocks=24)
    sched.kv.pool = mod.HitCountBlockPool(24, True)
    contract(sched.kv.pool)
    rng = random.Random(0)
    prefix = [3] * 8
    spec = [(f"r{i}", prefix + [rng.randrange(50) for _ in range(rng.randint(1, 30))],
             rng.randint(1, 20)) for i in range(12)]
    run_checked(fake, sched, spec)
    expect(sched.num_preemptions_total > 0, "the pool should have preempted (check bug)")
    say(f"12 requests in 24 blocks, {sched.num_preemptions_total} preemptions: KV invariants "
        "hold, every token right")


# -- 6.3 KV sizing ------------------------------------------------------------------------------
def check_kv_sizing(mod, say) -> None:
    from nanoserve.memory import memory_report
    llama = str(LESSONS.parent / "examples" / "llama-3-8b-config.json")
    cases = [dict(model="nanoserve-tiny"), dict(model=llama, device_memory_gb=24),
             dict(model=llama, device_memory_gb=80, block_size=32),
             dict(model=llama, device_memory_gb=40, kv_cache_dtype="fp8"),
             dict(model=llama, device_memory_gb=80, tensor_parallel_size=2)]
    for case in cases:
        r = memory_report(**case)
        got = mod.kv_bytes_per_token(r.num_layers, r.num_kv_heads, r.head_dim,
                                     r.kv_cache_dtype.itemsize)
        expect(got == r.kv_bytes_per_token, f"{case}: kv_bytes_per_token {got}, nanoserve "
               f"memory says {r.kv_bytes_per_token}")
        got = mod.num_kv_blocks(r.kv_budget_bytes, r.kv_bytes_per_token, r.block_size)
        expect(got == r.num_blocks,
               f"{case}: num_kv_blocks {got}, nanoserve memory says {r.num_blocks}")
    say(f"bytes per token and blocks agree with `nanoserve memory` on {len(cases)} setups")
    for seqs in (8, 12, 20):
        r = memory_report(model=llama, device_memory_gb=24)
        length = mod.max_model_len_for(r.num_blocks, r.block_size, seqs)
        fits = memory_report(model=llama, device_memory_gb=24, max_model_len=length).num_seqs
        more = memory_report(model=llama, device_memory_gb=24,
                             max_model_len=length + r.block_size).num_seqs
        expect(fits >= seqs > more, f"max_model_len_for(..., {seqs}) = {length}: at that length "
               f"{fits} sequences fit, at {length + r.block_size} {more}; the answer is the "
               f"largest length at which {seqs} fit")
    say("max_model_len_for: the largest length at which 8, 12, 20 sequences of Llama-3-8B fit "
        "on 24 GiB")


# -- 7.3 top-k without a sort -----------------------------------------------------------------
def check_top_k(mod, say) -> None:
    import torch

    from nanoserve.sampler import apply_top_k_top_p
    gen = torch.Generator().manual_seed(0)
    vocab = 1000
    logits = (torch.randn(6, vocab, generator=gen) * 3).round()     # many ties
    top_k = torch.tensor([1, 5, 50, vocab, 3, vocab - 1])
    want = apply_top_k_top_p(logits.clone(), top_k, int(top_k[top_k < vocab].max()), None)
    seen_k = []
    real_topk = torch.topk
    saved = {(owner, name): getattr(owner, name) for owner in (torch, torch.Tensor)
             for name in ("sort", "argsort", "msort", "topk") if hasattr(owner, name)}

    def no_sort(*args, **kwargs):
        raise AssertionError("you sorted the whole vocabulary: find each row's k-th largest "
                             "logit with torch.topk (or kthvalue) instead")

    def topk(x, k, *args, **kwargs):
        seen_k.append(k)
        return real_topk(x, k, *args, **kwargs)
    try:
        for (owner, name) in saved:
            setattr(owner, name, topk if name == "topk" else no_sort)
        got = mod.top_k_mask(logits.clone(), top_k)
    finally:
        for (owner, name), fn in saved.items():
            setattr(owner, name, fn)
    expect(max(seen_k, default=0) < vocab, f"topk over the whole vocabulary (k = {max(seen_k)}) "
           "is a sort in disguise: ask only for the largest k a row needs")
    expect(got.shape == want.shape and torch.equal(got, want),
           f"rows {sorted(set(torch.nonzero(got != want)[:, 0].tolist()))} differ from nanoserve's "
           "top-k: keep each row's k largest logits and every logit tied with the k-th, set the "
           "rest to -inf; rows with top_k >= vocab keep everything")
    say("6 rows with ties, top_k 1..vocab: equal to nanoserve's sampler, no full sort")


class Exercise(NamedTuple):
    file: str
    title: str
    check: Callable


EXERCISES = {
    "1.3": Exercise("lesson1_engine_loop.py", "the engine loop, by hand", check_engine_loop),
    "2.3": Exercise("lesson2_paged_decode.py", "decode attention through a block table",
                    check_paged_decode),
    "3.3": Exercise("lesson3_shortest_job_first.py", "a shortest-job-first waiting queue",
                    check_shortest_job_first),
    "3.4": Exercise("lesson3_static_batching.py", "static batching, to compare",
                    check_static_batching),
    "4.3": Exercise("lesson4_cheapest_victim.py", "preempt the cheapest request to recompute",
                    check_cheapest_victim),
    "5.3": Exercise("lesson5_hit_count_eviction.py", "evict the block with the fewest hits",
                    check_hit_count_eviction),
    "6.3": Exercise("lesson6_kv_sizing.py", "the KV budget in numbers", check_kv_sizing),
    "7.3": Exercise("lesson7_top_k.py", "top-k without sorting the vocabulary", check_top_k),
}


def path_of(exercise_id: str, solution: bool = False) -> Path:
    if exercise_id not in EXERCISES:
        raise ValueError(f"exercise must be one of {', '.join(EXERCISES)} (got {exercise_id!r})")
    return LESSONS / ("solutions" if solution else "exercises") / EXERCISES[exercise_id].file


def check(exercise_id: str, solution: bool = False, say=print) -> bool:
    """Run one exercise's checks; True when all pass. Says what passed, or why not."""
    path = path_of(exercise_id, solution)
    say(f"exercise {exercise_id}, {EXERCISES[exercise_id].title}: "
        f"{path.relative_to(LESSONS.parent)}")
    try:
        EXERCISES[exercise_id].check(load(path), lambda line: say(f"  ok   {line}"))
    except NotImplementedError as e:
        say(f"  FAIL not implemented yet: {e}")
        return False
    except AssertionError as e:
        say(f"  FAIL {e}")
        return False
    except Exception:   # the learner's code crashed: show where, in their file
        say("  FAIL your code raised:\n" + traceback.format_exc(limit=-3))
        return False
    say("  passed")
    return True


def main(action: str, exercise_id: str | None = None, solution: bool = False) -> int:
    """`nanoserve exercise list | check ID [--solution]`; returns the exit status."""
    if action == "list":
        for eid, ex in EXERCISES.items():
            print(f"{eid}  {ex.title:45} lessons/exercises/{ex.file}")
        return 0
    if exercise_id is None:
        raise ValueError("exercise: give the exercise to check, e.g. "
                         "`nanoserve exercise check 3.3`")
    return 0 if check(exercise_id, solution) else 1
