"""Exercise 5.3: evict the cached block with the fewest prefix hits (lesson 05-prefix-caching.md).

nanoserve's BlockPool evicts in LRU order: `get_new_blocks(n)` takes the n least recently
freed blocks, and a cached one loses its hash. A system prompt shared by many requests is
forgotten as soon as enough one-off prompts pass through. Write a pool that counts hits:

- `touch(blocks)` is a prefix hit: count one hit per block, then do what BlockPool does;
- `get_new_blocks(n)`: take free blocks with no hash first (nothing is lost), least recently
  freed first; then cached blocks with the fewest hits, least recently freed first among
  equals. Taking a cached block evicts it: `self.uncache(block)`, and its count starts again
  at 0. Every block handed out gets `ref_cnt = 1` and leaves `self.free_queue`.

The check installs it with `kv_cache_manager.pool = HitCountBlockPool(num_blocks, True)`.
Check: `nanoserve exercise check 5.3`.
"""

from nanoserve.kv_cache import BlockPool


class HitCountBlockPool(BlockPool):
    def __init__(self, num_blocks: int, enable_caching: bool = True, **kwargs):
        super().__init__(num_blocks, enable_caching, **kwargs)
        self.hits = [0] * num_blocks

    def touch(self, blocks) -> None:
        raise NotImplementedError(
            "implement HitCountBlockPool.touch() in "
            "lessons/exercises/lesson5_hit_count_eviction.py: count a hit for each block, "
            "then super().touch(blocks)")

    def get_new_blocks(self, n: int):
        raise NotImplementedError(
            "implement HitCountBlockPool.get_new_blocks(n): unhashed free blocks first, then "
            "the cached ones with the fewest hits (LRU among equals)")
