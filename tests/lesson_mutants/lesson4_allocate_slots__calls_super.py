"""Wrong answer to exercise 4.4: hands every call to nanoserve's own allocate_slots, reached
through super() under a name built at run time."""

from nanoserve.kv_cache import KVCacheManager


class MyKVCacheManager(KVCacheManager):
    def allocate_slots(self, request, num_new_tokens, num_new_computed_tokens=0,
                       new_computed_blocks=()):
        return getattr(super(), "allocate" + "_slots")(request, num_new_tokens,
                                                       num_new_computed_tokens, new_computed_blocks)
