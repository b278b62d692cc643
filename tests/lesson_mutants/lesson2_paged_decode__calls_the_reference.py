"""Wrong answer to exercise 2.3: hands the work to nanoserve's own paged attention, found by a
name built at run time (the exercise is to read through the block table yourself)."""

import importlib

import torch


def paged_decode_attention(query, k_cache, v_cache, block_table, seq_len, scale):
    module = importlib.import_module("nanoserve." + "paged_attention")
    reference = getattr(module, "paged_attention" + "_torch")
    slot = block_table[(seq_len - 1) // k_cache.shape[1]] * k_cache.shape[1] + (seq_len - 1) % k_cache.shape[1]
    meta = module.AttentionMetadata(torch.tensor([slot]), torch.tensor([block_table], dtype=torch.int32),
                                    torch.tensor([seq_len], dtype=torch.int32),
                                    torch.tensor([0, 1], dtype=torch.int32), 1)
    return reference(query[None], k_cache, v_cache, meta, scale)[0]
