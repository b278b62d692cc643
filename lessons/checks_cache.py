"""checks_cache.py: the checks of the KV cache exercises (4.4, 5.3, 5.4), run by lessons/checks.py.

Each runs the learner's piece of the KV cache manager (allocate_slots, the block pool's choice
of blocks to evict, the prefix-cache hash chain) on tests/fake_engine.py, whose "model" reads
every token back through the block tables, so a wrongly shared or reused block shows up as a
wrong token; a wrapper holds every call to the rule the exercise names, and 4.4 and 5.4 then
run the real engine with it against HF transformers' greedy tokens.
"""

from __future__ import annotations

import random
from contextlib import nullcontext

from check_kit import expect, expect_hf_greedy, fake_engine, oracle, own_work, prompt_ids, small_llm
from checks_scheduler import run_checked, scheduler_of


# -- 4.4 allocate_slots, all or nothing ------------------------------------------------------------
def all_or_nothing(kv) -> None:
    """Wrap allocate_slots: None changes nothing (and only when the free blocks are too few, a
    hit's blocks nobody holds not counted free); success gives the request exactly the blocks
    its tokens need: those it held, the hit's, then new ones taken from the free queue."""
    inner, bs, pool = kv.allocate_slots, kv.block_size, kv.pool

    def checked(request, num_new_tokens, num_hit=0, hits=()):
        rid = request.request_id
        before = (pool.num_free_blocks, {k: list(v) for k, v in kv.req_to_block_ids.items()})
        free, free_hits = set(pool.free_queue), sum(b.ref_cnt == 0 for b in hits)
        held = before[1].get(rid, [])
        total = request.num_computed_tokens + num_hit + num_new_tokens
        needed = -(-total // bs) - len(held) - len(hits)
        call = f"allocate_slots({rid}, {num_new_tokens}, {num_hit}, {len(hits)} hit blocks, " \
               f"{free_hits} of them free) with {request.num_computed_tokens} computed, " \
               f"{len(held)} blocks held, {before[0]} free"
        got = inner(request, num_new_tokens, num_hit, hits)
        if got is None:
            after = (pool.num_free_blocks, {k: list(v) for k, v in kv.req_to_block_ids.items()})
            expect(after == before, f"{call} returned None but changed the pool or the block "
                   f"tables: all or nothing")
            expect(needed > before[0] - free_hits, f"{call} returned None, yet {needed} new "
                   "blocks were enough")
            return None
        table = kv.req_to_block_ids.get(rid, [])
        expect(table == held + [b.block_id for b in hits] + list(got) and len(got) == needed
               and set(got) <= free - {b.block_id for b in hits}, f"{call} returned {got}; the "
               f"request holds {table}: its blocks, then the hit's, then {needed} new ones from "
               "the free queue")
        kv.hits_taken["hit"] += len(hits)
        kv.hits_taken["nobody held"] += free_hits
        return got

    def taken(n):
        expect(n <= pool.num_free_blocks, f"get_new_blocks({n}) with {pool.num_free_blocks} "
               "free: a hit block nobody holds was in the free queue; the hit takes it out, so "
               "it cannot be counted free as well")
        return take(n)
    take, pool.get_new_blocks, kv.allocate_slots = pool.get_new_blocks, taken, checked
    kv.hits_taken = {"hit": 0, "nobody held": 0}      # hit blocks taken; of them, free ones


def student_kv(mod, num_blocks, block_size, tracer=None):
    from nanoserve.trace import NULL_TRACER
    kv = mod.MyKVCacheManager(num_blocks, block_size, True, tracer or NULL_TRACER)
    all_or_nothing(kv)
    return kv


def check_allocate_slots(mod, say) -> None:
    from nanoserve.kv_cache import KVCacheManager
    from nanoserve.scheduler import Scheduler
    fake = fake_engine()
    rng = random.Random(2)
    prefixes = [[rng.randrange(1, 50) for _ in range(12)] for _ in range(2)]
    spec = [(f"r{i}", rng.choice(prefixes)[:rng.randint(0, 12)] +
             [rng.randrange(1, 50) for _ in range(rng.randint(1, 20))], rng.randint(1, 20))
            for i in range(12)]
    with own_work(mod, ["MyKVCacheManager.allocate_slots"], [KVCacheManager.allocate_slots],
                  "allocate the blocks yourself"):
        for block_size, num_blocks in ((4, 16), (16, 5)):
            sched = scheduler_of(Scheduler, num_blocks=num_blocks, block_size=block_size)
            sched.kv = student_kv(mod, num_blocks, block_size)
            outs, _ = fake.run(sched, [fake.make_request(*s) for s in spec],
                               check=lambda s: s.kv.check_invariants())
            for rid, prompt, max_tokens in spec:
                expect(outs[rid] == fake.reference_tokens(prompt, max_tokens),
                       f"blocks of {block_size}: request {rid} produced the wrong tokens")
            expect(sched.num_preemptions_total > 0, "no preemption (check bug)")
            expect(sched.kv.hits_taken["nobody held"] > 0, f"blocks of {block_size}: no "
                   f"request hit a cached block nobody held ({sched.kv.hits_taken}): does every "
                   "block full after a step enter the prefix cache (cache_full_blocks)?")
        say("12 requests sharing prefixes, 16 blocks of 4 and 5 of 16: preempted, prefix hits; "
            "every call all or nothing, exactly the blocks needed; KV invariants hold")
        llm = small_llm()
        core = llm.engine
        core.kv_cache_manager = core.scheduler.kv = student_kv(
            mod, core.config.num_kv_blocks, core.config.block_size, core.tracer)
        for _ in range(2):       # the second time, every prompt hits blocks nobody holds
            expect_hf_greedy(llm, prompt_ids(llm))
        expect(core.scheduler.num_preemptions_total > 0, "no preemption (check bug)")
        expect(core.kv_cache_manager.hits_taken["nobody held"] > 0, "the second time, no "
               "prompt hit its cached blocks: does every full block enter the prefix cache?")
    say("in the real engine, preempted, every prompt twice (hits on cached free blocks): HF's "
        "greedy tokens, every block freed")


# -- 5.4 the prefix-cache hash chain ------------------------------------------------------------
def hash_chain_requests(fake):
    """One after another, bs 4: repeated blocks, a block seen before at another position, and a
    prompt that continues an earlier request's output (its last block was full only then)."""
    a, b, c = [1, 2, 3, 4], [5, 6, 7, 8], [9, 9, 9, 9]
    first = fake.make_request("first", a + a + b + [9], 6)
    yield first
    yield fake.make_request("same-start", a + c + [7], 3)
    yield fake.make_request("moved-block", b + a + [1], 3)
    yield fake.make_request("repeat", a + a + a + [2], 3)
    yield fake.make_request("continues", first.all_token_ids[:18] + [42, 43], 3)


def collision_prompts(bs: int) -> list[list[int]]:
    """Prompts whose blocks a chain must tell apart, or must not: [1, 23] against [12, 3] (digits
    without a separator), 257 against 1 and 70000 against 4464 (a byte or two bytes a token), a
    block after another parent, and equal prefixes (their hashes must be equal)."""
    pad = list(range(100, 100 + bs - 4))
    first, other = [1, 23, 4, 5] + pad, [12, 3, 4, 5] + pad
    return [first + other, other + other, [257, 2, 3, 4] + pad + first, [1, 2, 3, 4] + pad + first,
            [70000, 9, 9, 9] + pad + other, [4464, 9, 9, 9] + pad + other, first + other + first]


def expect_same_equalities(mod, bs: int) -> None:
    """Two blocks of collision_prompts share a hash in the learner's chain exactly when they do in
    nanoserve's: equal hashes mean equal prefixes."""
    from nanoserve.kv_cache import KVCacheManager
    fake = fake_engine()
    prompts = collision_prompts(bs)
    mine, ref = mod.HashChainKVCacheManager(4, bs, True), KVCacheManager(4, bs, True)
    got = [list(mine.block_hashes(fake.make_request(f"p{i}", p, 1))) for i, p in enumerate(prompts)]
    with oracle():
        want = [ref.block_hashes(fake.make_request(f"p{i}", p, 1)) for i, p in enumerate(prompts)]
    where = [(i, j) for i, hashes in enumerate(want) for j in range(len(hashes))]
    expect([len(h) for h in got] == [len(h) for h in want], f"blocks of {bs}: prompts of "
           f"{[len(p) for p in prompts]} tokens got {[len(h) for h in got]} hashes: one per full "
           "block")
    for a in where:
        for b in where:
            same = got[a[0]][a[1]] == got[b[0]][b[1]]
            expect(same == (want[a[0]][a[1]] == want[b[0]][b[1]]), f"blocks of {bs}: block "
                   f"{a[1]} of {prompts[a[0]]} and block {b[1]} of {prompts[b[0]]} "
                   f"{'share' if same else 'do not share'} a hash: equal hashes must mean equal "
                   "prefixes (parent included, every token id kept whole)")


def check_hash_chain(mod, say) -> None:
    from nanoserve.kv_cache import KVCacheManager, hash_block
    from nanoserve.scheduler import Scheduler
    fake = fake_engine()
    hits = {}
    with own_work(mod, ["HashChainKVCacheManager.block_hashes"],
                  [hash_block, KVCacheManager.block_hashes], "build the chain from hashlib"):
        for bs in (4, 16):
            expect_same_equalities(mod, bs)
        say("blocks of 4 and 16: [1, 23] and [12, 3], 257 and 1, 70000 and 4464, one block after "
            "two parents: equal hashes exactly for equal prefixes")
        for name, cls in (("nanoserve", KVCacheManager), ("yours", mod.HashChainKVCacheManager)):
            sched = scheduler_of(Scheduler, num_blocks=32)
            sched.kv = cls(32, 4, True)
            runner, hits[name] = fake.FakeRunner(32, 4), {}
            for request in hash_chain_requests(fake):
                before = sched.kv.prefix_cache_hits
                with oracle() if cls is KVCacheManager else nullcontext():
                    fake.run(sched, [request], check=lambda s: s.kv.check_invariants(),
                             runner=runner)
                expect(request.output_token_ids == fake.reference_tokens(
                    request.prompt_token_ids, request.max_tokens), f"{request.request_id} "
                    "produced the wrong tokens")
                rid = request.request_id
                hits[name][rid] = got = sched.kv.prefix_cache_hits - before
                want = hits["nanoserve"][rid]
                expect(got == want, f"{rid} (prompt {request.prompt_token_ids}, after "
                       f"{list(hits[name])[:-1]}) hit {got} tokens of the prefix cache; "
                       f"nanoserve's chain hits {want}")
        say(f"repeated, moved and continued blocks: the same prefix hits as nanoserve's chain "
            f"{hits['yours']}")
        llm = small_llm(num_kv_blocks=32, max_model_len=64)
        core = llm.engine
        core.kv_cache_manager = core.scheduler.kv = mod.HashChainKVCacheManager(
            32, 4, True, core.tracer)
        a, b = prompt_ids(llm)[2][:4], prompt_ids(llm)[3][:4]
        for prompt in (a + a + b + [9], b + a + [9], a + a + a + [9]):     # one after another
            expect_hf_greedy(llm, [prompt], 8)
        expect(core.kv_cache_manager.prefix_cache_hits > 0, "no prefix hit at all")
    say("in the real engine, repeated and moved blocks: HF's greedy tokens")


# -- 5.3 hit-count eviction --------------------------------------------------------------------
def contract(pool) -> None:
    """Wrap the pool's touch and get_new_blocks with an oracle that counts hits itself. Every
    block handed out is held once, out of the free queue, and no longer in the prefix cache (a
    stale hash would serve new content as an old prefix); and the blocks taken follow the rule:
    blocks without a hash first, then cached ones by fewest hits since they were cached, least
    recently freed first among equals."""
    get_new_blocks, touch = pool.get_new_blocks, pool.touch
    hits = [0] * pool.num_blocks

    def counted(blocks) -> None:
        for b in blocks:
            hits[b.block_id] += 1
        touch(blocks)

    def checked(n: int):
        free = list(pool.free_queue.values())            # least recently freed first
        cached = [b for b in free if b.block_hash is not None]
        num_cached = max(0, n - (len(free) - len(cached)))
        # sorted() is stable: equal hits stay in LRU order
        want = {b.block_id for b in sorted(cached, key=lambda b: hits[b.block_id])[:num_cached]}
        was_cached = {b.block_id: hits[b.block_id] for b in cached}
        queue = [(b.block_id, was_cached.get(b.block_id, "-")) for b in free]
        blocks = get_new_blocks(n)
        expect(len(blocks) == n, f"get_new_blocks({n}) returned {len(blocks)} blocks")
        for b in blocks:
            expect(b.ref_cnt == 1 and b.block_id not in pool.free_queue,
                   f"block {b.block_id}: a new block has ref_cnt 1 and leaves the free queue")
            expect(b.block_hash is None and b not in pool.cached_blocks.values(),
                   f"block {b.block_id} was evicted but keeps its hash: call self.uncache(block)")
        got = {b.block_id for b in blocks if b.block_id in was_cached}
        expect(got == want, f"get_new_blocks({n}) evicted cached blocks {sorted(got)} with hits "
               f"{[was_cached[i] for i in sorted(got)]}; the rule takes {sorted(want)} with hits "
               f"{[was_cached[i] for i in sorted(want)]} (free queue, least recently freed first: "
               f"{queue}; '-' = no hash)")
        for b in blocks:
            hits[b.block_id] = 0                         # new content: no hits yet
        return blocks
    pool.get_new_blocks, pool.touch = checked, counted


def check_hit_count_eviction(mod, say) -> None:
    from nanoserve.kv_cache import BlockPool
    methods = ["HitCountBlockPool.touch", "HitCountBlockPool.get_new_blocks"]
    with own_work(mod, methods, [BlockPool.get_new_blocks], "choose the blocks yourself"):
        for block_size in (4, 16):
            with oracle():
                lru = hot_and_cold(None, block_size)
            expect(lru == 0, "LRU should have evicted the hot prefix (check bug)")
            hits = hot_and_cold(mod.HitCountBlockPool, block_size)
            expect(hits == 2 * block_size, f"blocks of {block_size}: hot2 hit {hits} tokens: the "
                   f"hot prefix ({2 * block_size} tokens, hit once before) must outlive six "
                   "one-off prompts never hit")
        say("blocks of 4 and 16: a hot prefix survives six one-off prompts (LRU: 0 hits); every "
            "block taken follows the rule; evicted blocks lose their hash")
        for block_size in (4, 16):
            retried_lookups(mod.HitCountBlockPool, block_size)
        say("a request looked up again and again while it waits for blocks is no hit: only "
            "blocks a request takes (touch) count")
        sched = pooled(mod.HitCountBlockPool, 24)
        rng = random.Random(0)
        prefix = [3] * 8
        spec = [(f"r{i}", prefix + [rng.randrange(50) for _ in range(rng.randint(1, 30))],
                 rng.randint(1, 20)) for i in range(12)]
        run_checked(fake_engine(), sched, spec)
        expect(sched.num_preemptions_total > 0, "the pool should have preempted (check bug)")
    say(f"12 requests in 24 blocks, {sched.num_preemptions_total} preemptions: KV invariants "
        "hold, every token right")


def pooled(pool, num_blocks, block_size=4, **config):
    """A scheduler on the fake engine whose block pool is `pool` (None: nanoserve's), checked."""
    from nanoserve.scheduler import Scheduler
    sched = scheduler_of(Scheduler, num_blocks=num_blocks, block_size=block_size, **config)
    if pool:
        sched.kv.pool = pool(num_blocks, True)
        contract(sched.kv.pool)
    return sched


def one_after_another(sched, spec, fake, runner) -> dict[str, int]:
    """Run (id, prompt, max_tokens) requests one after another (the cache must remember);
    returns each one's prefix hits, in tokens."""
    hits = {}
    for rid, prompt, max_tokens in spec:
        before = sched.kv.prefix_cache_hits
        outs, _ = fake.run(sched, [fake.make_request(rid, prompt, max_tokens)],
                           check=lambda s: s.kv.check_invariants(), runner=runner)
        expect(outs[rid] == fake.reference_tokens(prompt, max_tokens),
               f"{rid} produced the wrong tokens: it was served a block whose content changed")
        hits[rid] = sched.kv.prefix_cache_hits - before
    return hits


def hot_and_cold(pool, block_size) -> int:
    """Two requests share a hot prefix of two blocks, six one-off prompts of five blocks pass
    through 12 blocks, a third request comes back to the hot prefix: its hit, in tokens."""
    fake, bs = fake_engine(), block_size
    hot = [7] * (2 * bs)
    spec = ([(f"hot{i}", hot + [i + 1] * 3, 2) for i in range(2)]
            + [(f"cold{i}", [10 + i] * (5 * bs), 2) for i in range(6)]
            + [("hot2", hot + [9] * 3, 2)])
    sched = pooled(pool, 12, bs)
    return one_after_another(sched, spec, fake, fake.FakeRunner(12, bs))["hot2"]


def retried_lookups(pool, block_size) -> None:
    """Prefixes x and y are cached, never hit (x freed first). A long request fills the pool;
    one that would hit x waits for blocks, looked up again at every step; when the long one
    must evict, x has still no hit: it goes first (the contract checks it)."""
    fake, u = fake_engine(), block_size // 4
    x, y = [1] * (8 * u), [3] * (8 * u)
    sched = pooled(pool, 12, block_size, max_model_len=256)
    runner = fake.FakeRunner(12, block_size)
    one_after_another(sched, [("x", x + [2], 2), ("y", y + [4], 2)], fake, runner)
    spec = [("long", [6] * (24 * u), 12 * u), ("x-again", x + [7] * (20 * u), 2)]
    outs, _ = fake.run(sched, [fake.make_request(*s) for s in spec], runner=runner,
                       check=lambda s: s.kv.check_invariants())
    for rid, prompt, max_tokens in spec:
        expect(outs[rid] == fake.reference_tokens(prompt, max_tokens),
               f"{rid} produced the wrong tokens")
