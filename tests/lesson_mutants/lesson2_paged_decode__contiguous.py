"""Wrong answer to exercise 2.3: reads seq_len slots from the request's first block on, as if
its blocks were contiguous."""

import torch


def paged_decode_attention(query, k_cache, v_cache, block_table, seq_len, scale):
    start = block_table[0] * k_cache.shape[1]
    k = k_cache.flatten(0, 1)[start:start + seq_len]
    v = v_cache.flatten(0, 1)[start:start + seq_len]
    group = query.shape[0] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.einsum("hd,shd->hs", query, k) * scale
    return torch.einsum("hs,shd->hd", scores.softmax(dim=-1), v)
