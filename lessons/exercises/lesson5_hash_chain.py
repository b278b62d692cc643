"""Exercise 5.4: the prefix-cache hash chain (lesson 05-prefix-caching.md).

The prefix cache finds a block by its hash: when a request arrives, the manager looks up its
blocks' hashes in order and reuses every block found, until the first miss. Goal: the hashes
themselves. Two blocks may share a hash only if reusing one for the other gives the same K/V
(think about what a block's K/V depend on); and a block gets its hash once, so hash only what
can no longer change.

Interface (nanoserve/kv_cache.py, KVCacheManager):
    block_hashes(self, request) -> list[bytes]
        the hashes of the request's full blocks, in order, over request.all_token_ids (prompt
        and output so far) with self.block_size tokens a block. It is called again and again as
        the request grows; `request.block_hashes` is an empty list the request carries for
        you to keep what you computed (the list you return may be that list).
Use hashlib (sha256 is what nanoserve and vLLM use); not nanoserve's own hash_block.

The check first asks your chain for the hashes of prompts whose blocks must not collide (token
ids such as [1, 23] and [12, 3], 257 and 1, ids above 65535, a block after two parents) or must
(equal prefixes), with blocks of 4 and of 16 tokens. Then it runs requests one after another
(repeated blocks, a block met before at another
position, a prompt that continues an earlier request's output) on the model-free engine beside
nanoserve's manager: every request must hit as many cached tokens as with nanoserve's chain.
Then the real engine with your manager, against HF's greedy tokens.
Check: `nanoserve exercise check 5.4`.
"""

import hashlib  # noqa: F401

from nanoserve.kv_cache import KVCacheManager


class HashChainKVCacheManager(KVCacheManager):
    def block_hashes(self, request):
        raise NotImplementedError(
            "implement HashChainKVCacheManager.block_hashes in lessons/exercises/"
            "lesson5_hash_chain.py: the hashes of the request's full blocks")
