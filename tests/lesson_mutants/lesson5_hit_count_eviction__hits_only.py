"""Wrong answer to exercise 5.3: orders free blocks by hits alone: an empty block and a cached block never
hit tie, and the cached one may go first (a prefix lost for nothing)."""

from nanoserve.kv_cache import BlockPool


class HitCountBlockPool(BlockPool):
    def __init__(self, num_blocks, enable_caching=True, **kwargs):
        super().__init__(num_blocks, enable_caching, **kwargs)
        self.hits = [0] * num_blocks

    def touch(self, blocks):
        for block in blocks:
            self.hits[block.block_id] += 1
        super().touch(blocks)

    def get_new_blocks(self, n):
        if n > self.num_free_blocks:
            raise ValueError(f"cannot get {n} blocks: only {self.num_free_blocks} free")
        order = sorted(self.free_queue.values(), key=lambda b: self.hits[b.block_id])
        out = []
        for block in order[:n]:
            del self.free_queue[block.block_id]
            if block.block_hash is not None:
                self.uncache(block)
                self.hits[block.block_id] = 0
            block.ref_cnt = 1
            out.append(block)
        return out
