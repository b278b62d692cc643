"""Exercise 5.3 (reference solution): evict the cached block with the fewest prefix hits.

LRU forgets a system prompt that many requests share as soon as enough one-off prompts pass
through. Counting hits protects it: when a block must be taken from the free queue, take a
free block with no hash first (nothing is lost), else the cached block with the fewest hits,
least recently freed first among equals. An evicted block starts again from 0 hits.
"""

from nanoserve.kv_cache import BlockPool


class HitCountBlockPool(BlockPool):
    def __init__(self, num_blocks: int, enable_caching: bool = True, **kwargs):
        super().__init__(num_blocks, enable_caching, **kwargs)
        self.hits = [0] * num_blocks

    def touch(self, blocks) -> None:
        for block in blocks:
            self.hits[block.block_id] += 1
        super().touch(blocks)

    def get_new_blocks(self, n: int):
        if n > self.num_free_blocks:
            raise ValueError(f"cannot get {n} blocks: only {self.num_free_blocks} free")
        # The free queue is in LRU order, and sorted() is stable: least recently freed first.
        order = sorted(self.free_queue.values(),
                       key=lambda b: (b.block_hash is not None, self.hits[b.block_id]))
        out = []
        for block in order[:n]:
            del self.free_queue[block.block_id]
            if block.block_hash is not None:
                self.uncache(block)
                self.hits[block.block_id] = 0
                if self.tracer.enabled:
                    self.tracer.emit("evict", block=block.block_id)
            block.ref_cnt = 1
            out.append(block)
        return out
