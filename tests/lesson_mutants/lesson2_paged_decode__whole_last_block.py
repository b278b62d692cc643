"""Wrong answer to exercise 2.3: attends over every slot of the request's blocks, including
the unfilled tail of its last block."""

import torch


def paged_decode_attention(query, k_cache, v_cache, block_table, seq_len, scale):
    block_size = k_cache.shape[1]
    blocks = torch.tensor(block_table[:-(-seq_len // block_size)])
    k = k_cache[blocks].flatten(0, 1)
    v = v_cache[blocks].flatten(0, 1)
    group = query.shape[0] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.einsum("hd,shd->hs", query, k) * scale
    return torch.einsum("hs,shd->hd", scores.softmax(dim=-1), v)
