"""Exercise 5.3: evict the cached block with the fewest prefix hits (lesson 05-prefix-caching.md).

nanoserve's BlockPool evicts in LRU order: a system prompt shared by many requests is
forgotten as soon as enough one-off prompts pass through. Goal: a pool that, when it must
hand out blocks, loses as little of the prefix cache as it can:

- a free block that holds no cached prefix (no hash) is always taken before a cached one;
- among cached blocks, the one with the fewest prefix hits since its content was cached goes
  first; among equal counts, the least recently freed.

Interface (nanoserve/kv_cache.py, BlockPool), the two methods to override:
    touch(blocks)       the scheduler found `blocks` in the prefix cache: a hit for each
    get_new_blocks(n)   n blocks for new content: each with ref_cnt 1, out of
                        `self.free_queue` (an OrderedDict, least recently freed first), and
                        out of the prefix cache if it was in it (`self.uncache(block)`)

The check installs it with `kv_cache_manager.pool = HitCountBlockPool(num_blocks, True)` and
checks every choice your pool makes against its own count of hits (blocks a request takes,
touch(); a request looked up again and again while it waits for blocks takes none), with
blocks of 4 and of 16 tokens.
Check: `nanoserve exercise check 5.3`.
"""

from nanoserve.kv_cache import BlockPool


class HitCountBlockPool(BlockPool):
    def __init__(self, num_blocks: int, enable_caching: bool = True, **kwargs):
        super().__init__(num_blocks, enable_caching, **kwargs)

    def touch(self, blocks) -> None:
        raise NotImplementedError(
            "implement HitCountBlockPool.touch() in "
            "lessons/exercises/lesson5_hit_count_eviction.py: a prefix hit on each block")

    def get_new_blocks(self, n: int):
        raise NotImplementedError(
            "implement HitCountBlockPool.get_new_blocks(n): n blocks for new content, losing "
            "the least-hit cached prefixes")
