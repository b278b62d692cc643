"""The KV cache manager: block tables, prefix hits, LRU eviction, and its invariants
(ARCHITECTURE.md, Invariants) under random interleavings (hypothesis)."""

from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from fake_engine import make_request
from nanoserve.kv_cache import KVCacheManager, hash_block

BS = 4


def admit(kv, req, num_new=None):
    """What the scheduler does for a waiting request: prefix lookup, then allocate."""
    hit, num_hit = kv.get_computed_blocks(req)
    num_new = req.num_tokens - num_hit if num_new is None else num_new
    new = kv.allocate_slots(req, num_new, num_hit, hit)
    if new is not None:
        req.num_computed_tokens = num_hit + num_new
    return new, num_hit


def test_hash_is_stable_and_chained():
    # sha256 of the bytes: the same across processes and runs (not Python's salted hash()).
    import array
    import hashlib
    expected = hashlib.sha256(b"" + array.array("q", [1, 2, 3, 4]).tobytes()).digest()
    assert hash_block(None, [1, 2, 3, 4]) == expected
    assert hash_block(b"x", [1, 2, 3, 4]) != expected


def test_allocate_free_and_block_table_order():
    kv = KVCacheManager(num_blocks=8, block_size=BS, enable_caching=False)
    req = make_request("a", list(range(10)), 4)
    new, _ = admit(kv, req)
    assert new == [0, 1, 2] and kv.req_to_block_ids["a"] == [0, 1, 2]
    assert kv.pool.num_free_blocks == 5
    # Two more tokens fit in block 2 (slots 10, 11); a third needs a new block.
    req.all_token_ids += [1, 1, 1]
    assert kv.allocate_slots(req, 2) == []
    req.num_computed_tokens += 2
    assert kv.allocate_slots(req, 1) == [3]
    kv.free(req)
    assert kv.pool.num_free_blocks == 8
    # Freed tail first: the LRU end of the free queue holds the request's head last.
    assert list(kv.pool.free_queue)[-4:] == [3, 2, 1, 0]


def test_allocate_is_all_or_nothing():
    kv = KVCacheManager(num_blocks=3, block_size=BS, enable_caching=False)
    req = make_request("a", list(range(16)), 1)
    assert kv.allocate_slots(req, 16) is None
    assert kv.pool.num_free_blocks == 3 and "a" not in kv.req_to_block_ids


def test_prefix_hit_shares_blocks_and_never_covers_last_token():
    kv = KVCacheManager(num_blocks=16, block_size=BS)
    a = make_request("a", list(range(12)), 1)
    admit(kv, a)
    b = make_request("b", list(range(12)), 1)     # same 12 tokens = 3 full blocks
    _, num_hit = admit(kv, b)
    assert num_hit == 8                           # not 12: the last token must be computed
    assert kv.req_to_block_ids["b"][:2] == kv.req_to_block_ids["a"][:2]
    assert kv.pool.blocks[kv.req_to_block_ids["a"][0]].ref_cnt == 2
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (24, 8)
    kv.check_invariants()


def test_freed_blocks_stay_cached_until_evicted_lru():
    kv = KVCacheManager(num_blocks=4, block_size=BS)
    a = make_request("a", list(range(8)) + [99], 1)   # 2 full blocks + 1 token
    admit(kv, a)
    kv.free(a)
    assert kv.pool.num_cached_free_blocks == 2
    b = make_request("b", list(range(8)) + [42], 1)   # hits both cached blocks
    _, num_hit = admit(kv, b)
    assert num_hit == 8
    kv.free(b)
    # c shares nothing and needs all 4 blocks: the cached ones are evicted.
    c = make_request("c", [7] * 16, 1)
    new, num_hit = admit(kv, c)
    assert num_hit == 0 and len(new) == 4 and kv.pool.num_cached_free_blocks == 0
    assert kv.get_computed_blocks(make_request("d", list(range(9)), 1)) == ([], 0)
    kv.check_invariants()


def test_uncomputed_block_is_not_left_in_cache_on_preempt():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    a = make_request("a", list(range(8)), 1)
    assert kv.allocate_slots(a, 8) is not None    # allocated and hashed, not yet computed
    kv.free(a)                                    # preempted before the forward ran
    assert kv.pool.num_cached_free_blocks == 0
    kv.check_invariants()


class KVCacheMachine(RuleBasedStateMachine):
    """Random admit / grow / free / preempt sequences over a small pool with colliding
    prompts (a 2-token alphabet), checking the invariants after every rule."""

    def __init__(self):
        super().__init__()
        self.kv = KVCacheManager(num_blocks=12, block_size=BS)
        self.live = {}
        self.n = 0

    @rule(prompt=st.lists(st.integers(0, 1), min_size=1, max_size=20))
    def admit(self, prompt):
        self.n += 1
        req = make_request(f"r{self.n}", prompt, 8)
        new, _ = admit(self.kv, req)
        if new is not None:
            self.live[req.request_id] = req

    @precondition(lambda self: self.live)
    @rule(data=st.data(), tokens=st.integers(1, 6))
    def grow(self, data, tokens):
        req = self.live[data.draw(st.sampled_from(sorted(self.live)))]
        req.all_token_ids += [1] * tokens
        if self.kv.allocate_slots(req, req.num_tokens - req.num_computed_tokens) is not None:
            req.num_computed_tokens = req.num_tokens

    @precondition(lambda self: self.live)
    @rule(data=st.data(), preempt=st.booleans())
    def free(self, data, preempt):
        req = self.live.pop(data.draw(st.sampled_from(sorted(self.live))))
        self.kv.free(req)
        if preempt:       # recompute preemption: back to zero, may be admitted again later
            req.num_computed_tokens = 0

    @invariant()
    def invariants_hold(self):
        self.kv.check_invariants()

    def teardown(self):
        for req in self.live.values():
            self.kv.free(req)
        assert self.kv.pool.num_free_blocks == self.kv.num_blocks


TestKVCacheProperties = KVCacheMachine.TestCase
TestKVCacheProperties.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
