"""Wrong answer to exercise 5.4: hands each block to nanoserve's hash_block, from a private copy
of kv_cache.py loaded again under another name (a scan of names and a patch of the imported
module see neither)."""

import importlib.util
from pathlib import Path

import nanoserve
from nanoserve.kv_cache import KVCacheManager

_spec = importlib.util.spec_from_file_location("my_cache", Path(nanoserve.__file__).parent / "kv_cache.py")
_copy = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_copy)


class HashChainKVCacheManager(KVCacheManager):
    def block_hashes(self, request):
        hashes, tokens, size = request.block_hashes, request.all_token_ids, self.block_size
        for i in range(len(hashes), len(tokens) // size):
            hashes.append(getattr(_copy, "hash" + "_block")(hashes[-1] if hashes else None,
                                                           tokens[i * size:(i + 1) * size]))
        return hashes
