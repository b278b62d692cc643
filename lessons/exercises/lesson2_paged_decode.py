"""Exercise 2.3: decode attention through a block table (lesson 02-paged-attention.md).

Goal: the attention output of a decoding request's new token over all of the request's
`seq_len` tokens, whose K and V (the new token's included, already stored) are in the paged
caches through its block table:

    softmax(q . K^T * scale) . V      over the request's seq_len tokens, and nothing else

Interface:
- `query`: [num_heads, head_dim]; return the same shape.
- `k_cache`, `v_cache`: [num_blocks, block_size, num_kv_heads, head_dim]; `block_table`: the
  request's physical block ids, in logical order (lesson 2: slot mapping).
- num_heads may be a multiple of num_kv_heads (grouped-query attention: lesson 2's primer).
- Every slot that is not one of the request's seq_len tokens holds garbage, on purpose.

The check runs blocks of 4 and of 16 tokens, 2, 4 and 1 query heads per KV head, scales other
than head_dim ** -0.5, against dense attention; nanoserve's paged attention may not run.

Check: `nanoserve exercise check 2.3`.
"""

import torch  # noqa: F401


def paged_decode_attention(query, k_cache, v_cache, block_table: list[int], seq_len: int,
                           scale: float):
    raise NotImplementedError(
        "implement paged_decode_attention in lessons/exercises/lesson2_paged_decode.py: the "
        "new token's attention over the request's seq_len tokens, read through its block table")
