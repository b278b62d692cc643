"""Exercise 4.4: allocate_slots, all or nothing (lesson 04-preemption.md).

Before a request computes tokens, the scheduler asks the KV cache manager for the slots they
will be written to: `allocate_slots(request, num_new_tokens)`. Goal: write it, for a manager
without prefix caching. After a successful call the request's block table holds exactly the
blocks its tokens need (those it has computed plus the new ones); when the pool cannot give
them, nothing may change at all, and the call says so, so that the scheduler can preempt and
try again (lesson 4, `Scheduler._make_room`).

Interface (nanoserve/kv_cache.py, KVCacheManager):
    allocate_slots(self, request, num_new_tokens, num_new_computed_tokens=0,
                   new_computed_blocks=()) -> list[int] | None
        returns the ids of the blocks newly given to the request (maybe []), or None when the
        pool has too few free blocks. With prefix caching off (as here) the last two arguments
        are always 0 and ().
What you may use: self.req_to_block_ids (request id -> its block table, a list of block ids;
a request has no entry before its first allocation), self.block_size, self.pool.num_free_blocks,
self.pool.get_new_blocks(n) (n blocks off the free queue), request.request_id and
request.num_computed_tokens. free(), the scheduler and the model runner read the block tables.

The check wraps every call (all or nothing, exactly the blocks needed), then runs the real
engine with your manager in a pool so small that requests are preempted, against HF's greedy
tokens.
Check: `nanoserve exercise check 4.4`.
"""

from nanoserve.kv_cache import KVCacheManager


class MyKVCacheManager(KVCacheManager):
    def allocate_slots(self, request, num_new_tokens, num_new_computed_tokens=0,
                       new_computed_blocks=()):
        raise NotImplementedError(
            "implement MyKVCacheManager.allocate_slots in lessons/exercises/"
            "lesson4_allocate_slots.py: the request's new blocks, all or nothing")
