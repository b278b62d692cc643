"""Wrong answer to exercise 4.4: takes the free blocks there are, then says None when they were
too few: the request keeps blocks the scheduler believes it never got."""

from nanoserve.kv_cache import KVCacheManager


class MyKVCacheManager(KVCacheManager):
    def allocate_slots(self, request, num_new_tokens, num_new_computed_tokens=0,
                       new_computed_blocks=()):
        held = self.req_to_block_ids.setdefault(request.request_id, [])
        total = request.num_computed_tokens + num_new_tokens
        wanted = max(0, -(-total // self.block_size) - len(held))
        got = [b.block_id for b in self.pool.get_new_blocks(min(wanted, self.pool.num_free_blocks))]
        held += got
        return got if len(got) == wanted else None
