"""Exercise 4.4: allocate_slots, all or nothing (lesson 04-preemption.md).

Before a request computes tokens, the scheduler asks the KV cache manager for the slots they
will be written to: `allocate_slots(request, num_new_tokens, ...)`. Goal: write it, for a
manager with prefix caching on. After a successful call the request's block table holds exactly
the blocks its tokens need (those it has computed, those its prefix hit brings, and the new
ones); when the pool cannot give them, nothing may change at all, and the call says so, so that
the scheduler can preempt and try again (lesson 4, `Scheduler._make_room`).

Interface (nanoserve/kv_cache.py, KVCacheManager):
    allocate_slots(self, request, num_new_tokens, num_new_computed_tokens=0,
                   new_computed_blocks=()) -> list[int] | None
        returns the ids of the blocks newly taken from the free queue (maybe []), or None when
        the pool has too few free blocks. At admission, `new_computed_blocks` are the cached
        blocks found for the request's prompt (its prefix hit, lesson 5) and
        `num_new_computed_tokens` the tokens they hold; later calls pass 0 and ().
What you may use: self.req_to_block_ids (request id -> its block table, a list of block ids;
a request has no entry before its first allocation), self.block_size, self.enable_caching,
request.request_id and request.num_computed_tokens, and the pool (self.pool):
    num_free_blocks       the blocks in the free queue, cached ones nobody holds included
    get_new_blocks(n)     n blocks off the free queue
    touch(blocks)         a prefix hit takes `blocks`: one holder more each; one nobody held
                          leaves the free queue (so it cannot be counted free as well)
    cache_full_blocks(blocks, hashes)   enter full blocks into the prefix cache (blocks cached
                          already are skipped); their hashes: self.block_hashes(request)
    blocks                every block, by id
Every block that is full after this step must enter the prefix cache, or no later request
can hit it. free(), the scheduler and the model runner read the block tables.

The check wraps every call (all or nothing, exactly the blocks needed, a hit's blocks taken
once), with blocks of 4 and of 16 tokens and requests that share prefixes, then runs the real
engine with your manager in a pool so small that requests are preempted, every prompt twice
(the second time, its blocks are cached with nobody holding them), against HF's greedy tokens.
Check: `nanoserve exercise check 4.4`.
"""

from nanoserve.kv_cache import KVCacheManager


class MyKVCacheManager(KVCacheManager):
    def allocate_slots(self, request, num_new_tokens, num_new_computed_tokens=0,
                       new_computed_blocks=()):
        raise NotImplementedError(
            "implement MyKVCacheManager.allocate_slots in lessons/exercises/"
            "lesson4_allocate_slots.py: the request's new blocks, all or nothing")
