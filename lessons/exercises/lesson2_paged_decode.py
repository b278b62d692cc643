"""Exercise 2.3: decode attention through a block table (lesson 02-paged-attention.md).

A decoding request brings one new token. Its K and V (the new token's included, already
stored) sit in the paged caches `k_cache` / `v_cache`, each shaped
[num_blocks, block_size, num_kv_heads, head_dim]. Token position p of the request lives in
physical block `block_table[p // block_size]` at offset `p % block_size`; the request has
`seq_len` tokens. Return the attention output of the new token:

    softmax(q . K^T * scale) . V      over the request's seq_len tokens only

- `query` is [num_heads, head_dim]; return the same shape.
- Grouped-query attention: num_heads may be a multiple of num_kv_heads; query head h uses KV
  head h // (num_heads // num_kv_heads).
- Read nothing past seq_len: the rest of the last block (and every other block) holds
  garbage the check fills in on purpose.

Read first: nanoserve/paged_attention.py (store_kv_torch, _gather_kv, paged_attention_torch).
Check: `nanoserve exercise check 2.3`.
"""

import torch  # noqa: F401


def paged_decode_attention(query, k_cache, v_cache, block_table: list[int], seq_len: int,
                           scale: float):
    raise NotImplementedError(
        "implement paged_decode_attention in lessons/exercises/lesson2_paged_decode.py: gather "
        "the request's K and V through block_table (first seq_len slots), then attend the query")
