"""Exercise 4.4 (reference solution): allocate_slots, all or nothing, with prefix caching on.

A request that will hold `total` tokens after this step (those computed, those its prefix hit
brings, the new ones) needs ceil(total / block_size) blocks. It has some already (none at
admission), the hit brings some (`new_computed_blocks`, cached blocks found for its prompt);
the rest must come from the free queue, all at once or not at all. A hit block that nobody holds
(ref count 0) is still in the free queue: taking it as a hit takes it out, so it cannot be
counted as a free block as well. If the pool has too few, return None and leave everything as
it was, so the scheduler can preempt someone and ask again (a failed admission must not leave
an empty block table behind: free() and the invariants would count it as a request holding
blocks). Then the blocks full after this step enter the prefix cache under their hashes.
"""

from nanoserve.kv_cache import KVCacheManager


class MyKVCacheManager(KVCacheManager):
    def allocate_slots(self, request, num_new_tokens, num_new_computed_tokens=0,
                       new_computed_blocks=()):
        held = self.req_to_block_ids.get(request.request_id, [])
        total = request.num_computed_tokens + num_new_computed_tokens + num_new_tokens
        num_new_blocks = max(0, -(-total // self.block_size) - len(held) - len(new_computed_blocks))
        free_hits = sum(1 for block in new_computed_blocks if block.ref_cnt == 0)
        if num_new_blocks > self.pool.num_free_blocks - free_hits:
            return None
        self.pool.touch(new_computed_blocks)
        new_ids = [b.block_id for b in self.pool.get_new_blocks(num_new_blocks)]
        table = held + [b.block_id for b in new_computed_blocks] + new_ids
        self.req_to_block_ids[request.request_id] = table
        if self.enable_caching:           # (cache_full_blocks skips the blocks cached already)
            num_full = total // self.block_size
            self.pool.cache_full_blocks([self.pool.blocks[i] for i in table[:num_full]],
                                        self.block_hashes(request)[:num_full])
        return new_ids
