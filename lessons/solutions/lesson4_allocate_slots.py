"""Exercise 4.4 (reference solution): allocate_slots, all or nothing (prefix caching off).

A request that will hold `total` tokens after this step needs ceil(total / block_size) blocks.
It has some already (none at admission); the difference must come from the free queue, all at
once or not at all: if the pool has too few, return None and leave everything as it was, so the
scheduler can preempt someone and ask again. A failed admission must not leave an empty block
table behind: free() and the invariants would count it as a request holding blocks.
"""

from nanoserve.kv_cache import KVCacheManager


class MyKVCacheManager(KVCacheManager):
    def allocate_slots(self, request, num_new_tokens, num_new_computed_tokens=0,
                       new_computed_blocks=()):
        held = self.req_to_block_ids.get(request.request_id, [])
        total = request.num_computed_tokens + num_new_tokens
        num_new_blocks = max(0, -(-total // self.block_size) - len(held))
        if num_new_blocks > self.pool.num_free_blocks:
            return None
        new_ids = [b.block_id for b in self.pool.get_new_blocks(num_new_blocks)]
        self.req_to_block_ids[request.request_id] = held + new_ids
        return new_ids
