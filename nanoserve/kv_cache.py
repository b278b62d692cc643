"""kv_cache.py: who owns which KV cache block (PagedAttention's bookkeeping, no tensors).

The KV cache is cut into blocks of `block_size` token slots. A request holds a *block
table*: its logical block i lives in physical block `block_table[i]`, so the slot of the
token at position p is `block_table[p // block_size] * block_size + p % block_size`:

    block_table [7, 1, 3], block_size 4, position 9 -> logical block 9 // 4 = 2
    -> physical block block_table[2] = 3, offset 9 % 4 = 1 -> slot 3 * 4 + 1 = 13

Two classes, as in vLLM V1:

- `BlockPool`: every physical block, its ref count, and the free queue. The free queue is
  in LRU order: blocks freed long ago are reused first, and a freed block *keeps its hash*
  until it is reused. That is the whole prefix cache: a later request whose prompt starts
  with the same tokens finds the block by hash and takes it back out of the free queue.
- `KVCacheManager`: the scheduler's view: which blocks each request holds, prefix-cache
  lookups (`get_computed_blocks`), `allocate_slots` (all or nothing: None when the pool
  cannot give enough blocks, so the scheduler may preempt) and `free`.

Block hash = sha256(parent block's hash + the block's token ids): a block's hash names the
whole prefix up to its end, so equal hashes mean equal prefixes. It is stable across
processes and runs, unlike Python's `hash()`. Only full blocks are hashed.

Run the property tests: `pytest tests/test_kv_cache.py`.
Lessons: lessons/02-paged-attention.md, lessons/04-preemption.md, lessons/05-prefix-caching.md
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from typing import TYPE_CHECKING, Optional, Sequence

from nanoserve.trace import NULL_TRACER

if TYPE_CHECKING:
    from nanoserve.request import Request


def hash_block(parent_hash: Optional[bytes], token_ids: Sequence[int]) -> bytes:
    """The prefix hash of one full block: depends on every token from position 0 to its end."""
    h = hashlib.sha256(parent_hash or b"")
    h.update(array("q", token_ids).tobytes())
    return h.digest()


class KVCacheBlock:
    __slots__ = ("block_id", "ref_cnt", "block_hash")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_cnt = 0           # live block tables holding this block
        self.block_hash: Optional[bytes] = None   # set while the block is in the prefix cache

    def __repr__(self) -> str:
        return f"KVCacheBlock({self.block_id}, ref_cnt={self.ref_cnt}, cached={self.block_hash is not None})"


class BlockPool:
    """All physical blocks; the LRU free queue; the hash -> block map of the prefix cache."""

    def __init__(self, num_blocks: int, enable_caching: bool, tracer=NULL_TRACER):
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.tracer = tracer
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        # OrderedDict gives O(1) pop-oldest (eviction), append (free) and remove-from-the-
        # middle (a prefix hit on a free cached block), which is all a free queue needs.
        self.free_queue: OrderedDict[int, KVCacheBlock] = OrderedDict(
            (b.block_id, b) for b in self.blocks)
        self.cached_blocks: dict[bytes, KVCacheBlock] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def num_cached_free_blocks(self) -> int:
        """Free blocks that still hold a prefix-cache entry (reusable by a hit until evicted)."""
        return sum(1 for b in self.free_queue.values() if b.block_hash is not None)

    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def get_cached_block(self, block_hash: bytes) -> Optional[KVCacheBlock]:
        return self.cached_blocks.get(block_hash)

    def get_new_blocks(self, n: int) -> list[KVCacheBlock]:
        """Take the n least recently freed blocks; a cached one loses its hash (eviction)."""
        if n > len(self.free_queue):
            raise ValueError(f"cannot get {n} blocks: only {len(self.free_queue)} free")
        out = []
        for _ in range(n):
            _, block = self.free_queue.popitem(last=False)
            if block.block_hash is not None:
                self.uncache(block)
                if self.tracer.enabled:
                    self.tracer.emit("evict", block=block.block_id)
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: Sequence[KVCacheBlock]) -> None:
        """A prefix hit: one more holder; a free cached block leaves the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self.free_queue[block.block_id]
            block.ref_cnt += 1

    def free_blocks(self, blocks: Sequence[KVCacheBlock]) -> None:
        """One holder fewer; a block nobody holds joins the tail of the free queue (it is
        the most recently used, so evicted last), keeping its hash."""
        for block in blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue[block.block_id] = block

    def cache_full_blocks(self, blocks: Sequence[KVCacheBlock], block_hashes: Sequence[bytes]) -> None:
        """Enter full blocks into the prefix cache. If another block already caches the same
        prefix (two requests computed it at once), keep that one and leave this one unhashed."""
        for block, block_hash in zip(blocks, block_hashes):
            if block.block_hash is None and block_hash not in self.cached_blocks:
                block.block_hash = block_hash
                self.cached_blocks[block_hash] = block

    def uncache(self, block: KVCacheBlock) -> None:
        """Drop a block's prefix-cache entry: its content can no longer be found by hash."""
        del self.cached_blocks[block.block_hash]
        block.block_hash = None


class KVCacheManager:
    """The scheduler's interface to the pool: per-request block tables and prefix hits."""

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 tracer=NULL_TRACER):
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.tracer = tracer
        self.pool = BlockPool(num_blocks, enable_caching, tracer)
        # request id -> its block table (physical block ids, logical order). The worker
        # reads these lists directly to build the block_tables tensor.
        self.req_to_block_ids: dict[str, list[int]] = {}
        # request id -> how many of its leading blocks are already in the prefix cache
        self.num_cached_blocks: dict[str, int] = {}
        # Prefix-cache counters, in tokens, as vLLM reports them.
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    def usage(self) -> float:
        return self.pool.usage()

    def block_hashes(self, request: "Request") -> list[bytes]:
        """The request's full-block hashes, extended as its tokens grow (each hashed once)."""
        hashes, tokens, bs = request.block_hashes, request.all_token_ids, self.block_size
        for i in range(len(hashes), len(tokens) // bs):
            hashes.append(hash_block(hashes[-1] if hashes else None, tokens[i * bs:(i + 1) * bs]))
        return hashes

    def get_computed_blocks(self, request: "Request") -> tuple[list[KVCacheBlock], int]:
        """Longest cached prefix of a request that has computed nothing yet.

        Returns (blocks, num_computed_tokens). The hit never covers the last token: its
        logits are needed to sample, so at least one token is always computed.
        """
        if not self.enable_caching:
            return [], 0
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        hit: list[KVCacheBlock] = []
        for block_hash in self.block_hashes(request)[:max_hit_blocks]:
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            hit.append(block)
        return hit, len(hit) * self.block_size

    def allocate_slots(self, request: "Request", num_new_tokens: int,
                       num_new_computed_tokens: int = 0,
                       new_computed_blocks: Sequence[KVCacheBlock] = (),
                       num_lookahead_tokens: int = 0) -> Optional[list[int]]:
        """Make room for `num_new_tokens` more tokens of `request` (after its prefix hit).

        All or nothing: returns the ids of the newly allocated blocks, or None when the
        pool cannot provide them (then nothing changed and the scheduler may preempt).
        The last `num_lookahead_tokens` of them are speculative drafts: they get slots, but
        no block holding one is hashed (a rejected draft must never serve a prefix hit).
        """
        block_ids = self.req_to_block_ids.get(request.request_id)
        is_admission = block_ids is None
        if is_admission:
            block_ids = self.req_to_block_ids[request.request_id] = []
        num_computed = request.num_computed_tokens + num_new_computed_tokens
        num_total_tokens = num_computed + num_new_tokens
        num_required = -(-num_total_tokens // self.block_size)
        num_new_blocks = max(0, num_required - len(block_ids) - len(new_computed_blocks))
        if num_new_blocks or new_computed_blocks:
            # Hit blocks that sit in the free queue stop being free once we take them.
            num_free_hits = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
            if num_new_blocks > self.pool.num_free_blocks - num_free_hits:
                if is_admission:
                    del self.req_to_block_ids[request.request_id]
                return None
        if is_admission and self.enable_caching:
            # Counted once per admission (not per failed attempt), in tokens, like vLLM.
            self.prefix_cache_queries += request.num_tokens
            self.prefix_cache_hits += num_new_computed_tokens
        if new_computed_blocks:
            self.pool.touch(new_computed_blocks)
            block_ids.extend(b.block_id for b in new_computed_blocks)
            self.num_cached_blocks[request.request_id] = len(block_ids)
            if self.tracer.enabled:
                self.tracer.emit("prefix_hit", req=request.request_id,
                                 blocks=[b.block_id for b in new_computed_blocks],
                                 tokens=num_new_computed_tokens)
        new_ids = []
        if num_new_blocks:
            new_ids = [b.block_id for b in self.pool.get_new_blocks(num_new_blocks)]
            block_ids.extend(new_ids)
            if self.tracer.enabled:
                self.tracer.emit("alloc", req=request.request_id, blocks=new_ids)

        if self.enable_caching:
            # Blocks that will be full after this step go into the cache now, as in vLLM:
            # a request admitted later in this same step (an n > 1 sibling) can then share
            # them, because every layer stores the whole batch's K/V before attending.
            num_cached = self.num_cached_blocks.get(request.request_id, 0)
            num_full = (num_total_tokens - num_lookahead_tokens) // self.block_size
            if num_full > num_cached:
                hashes = self.block_hashes(request)
                self.pool.cache_full_blocks(
                    [self.pool.blocks[i] for i in block_ids[num_cached:num_full]],
                    hashes[num_cached:num_full])
                self.num_cached_blocks[request.request_id] = num_full
        return new_ids

    def free(self, request: "Request") -> None:
        """Let go of all the request's blocks (finish, abort or preemption).

        Tail first, so that when the pool must evict, a prompt's tail goes before its head
        (the head is the part other requests are likeliest to share).
        """
        block_ids = self.req_to_block_ids.pop(request.request_id, None)
        self.num_cached_blocks.pop(request.request_id, None)
        if not block_ids:
            return
        blocks = [self.pool.blocks[i] for i in reversed(block_ids)]
        self.pool.free_blocks(blocks)
        # A block hashed when allocated this step but never computed (its request was
        # preempted before the forward) must not serve prefix hits.
        num_computed_blocks = request.num_computed_tokens // self.block_size
        for block in (self.pool.blocks[i] for i in block_ids[num_computed_blocks:]):
            if block.ref_cnt == 0 and block.block_hash is not None:
                self.pool.uncache(block)
        if self.tracer.enabled:
            self.tracer.emit("free", req=request.request_id, blocks=block_ids[::-1])

    def check_invariants(self) -> None:
        """ARCHITECTURE.md, Invariants, asserted (by the tests, and after every step with
        Config.debug = 2, `--debug 2`): free + used = total; each block's ref_cnt == the live
        block tables holding it; the free queue is exactly the unreferenced blocks; the hash
        map and the blocks agree."""
        pool = self.pool
        holders = [0] * pool.num_blocks
        for block_ids in self.req_to_block_ids.values():
            assert len(set(block_ids)) == len(block_ids), "a block appears twice in one table"
            for b in block_ids:
                holders[b] += 1
        used = sum(1 for h in holders if h > 0)
        assert used + pool.num_free_blocks == pool.num_blocks, "free + used != total"
        for block in pool.blocks:
            assert block.ref_cnt == holders[block.block_id], block
            assert (block.ref_cnt == 0) == (block.block_id in pool.free_queue), block
            if block.block_hash is not None:
                assert pool.cached_blocks[block.block_hash] is block, block
        assert all(b.block_hash == h for h, b in pool.cached_blocks.items())
