"""Exercise 2.3 (reference solution): one decode token's attention, read through a block table.

The request's K and V are not contiguous: token position p lives in physical block
block_table[p // block_size], at offset p % block_size. Gather the blocks in logical order,
cut to seq_len (the last block is only partly filled; the rest of it is someone else's
garbage or nothing at all), then attend as usual. With grouped-query attention (GQA) each KV
head serves num_heads // num_kv_heads query heads.
"""

import torch


def paged_decode_attention(query, k_cache, v_cache, block_table, seq_len, scale):
    block_size = k_cache.shape[1]
    blocks = torch.tensor(block_table[:-(-seq_len // block_size)])
    # [blocks, block_size, kv_heads, dim] -> [tokens, kv_heads, dim], then the first seq_len
    k = k_cache[blocks].flatten(0, 1)[:seq_len]
    v = v_cache[blocks].flatten(0, 1)[:seq_len]
    group = query.shape[0] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)              # [seq_len, num_heads, dim]
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("hd,shd->hs", query, k) * scale
    return torch.einsum("hs,shd->hd", scores.softmax(dim=-1), v)
