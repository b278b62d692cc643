"""paged_attention.py: the paged KV cache layout, writing K/V into it, and attention over it.

Every layer owns two cache tensors, K and V, each `[num_blocks, block_size, num_kv_heads, head_dim]`.
A request does not own contiguous memory: its block table maps its logical block i to a physical
block id, and token position p lives in physical slot

    slot = block_table[p // block_size] * block_size + p % block_size

Worked example: block_table [7, 1, 3], block_size 4, position 9 -> logical block 2 -> physical
block 3, offset 1 -> slot 3 * 4 + 1 = 13, i.e. k_cache[3, 1].

One step runs ONE flat batch that mixes every kind of request (vLLM V1 has no prefill/decode
phases). Request i brings query_len_i new tokens and has seq_len_i tokens in the cache once they
are stored, so its new token j sits at position seq_len_i - query_len_i + j and attends to every
position up to and including its own:

    prefill          no cached prefix,   query_len == seq_len
    chunked prefill  cached prefix,      1 < query_len < seq_len (also a prefix-cache hit)
    decode           cached prefix,      query_len == 1

The model stores K/V for the whole flat batch first and attends second, so the new
tokens are read back through the cache like any other: one code path for all three cases.

This file is the torch reference, the code the lessons cite and the oracle every other form is
tested against. The model calls it through the seam (layers.py: `RopeStoreKV` stores, `Attention`
attends): a backend chosen once at load may replace it with its own form of the same math, the
Triton kernels on CUDA (cuda/paged_attention_triton.py) or the C kernels on CPU (cpu/backend.py),
which read the cache in place instead of gathering each request's blocks into a copy.

Run the oracle tests (paged attention == dense scaled_dot_product_attention):
    pytest -q tests/test_paged_attention.py

Lesson: lessons/02-paged-attention.md
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from nanoserve.attention_metadata import AttentionMetadata


def store_kv_torch(
    key: Tensor, value: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor
) -> None:
    """Write key/value `[num_tokens, num_kv_heads, head_dim]` into slots `slot_mapping` of the caches;
    a token whose slot is -1 (a padded row of a captured step: step_inputs.py) is not stored."""
    # Viewing [num_blocks, block_size, kv_heads, dim] as [num_slots, kv_heads * dim] makes a slot
    # a plain row index (and the copy a row memcpy).
    row, stored = k_cache.shape[2] * k_cache.shape[3], slot_mapping >= 0
    k_cache.view(-1, row)[slot_mapping[stored]] = key.reshape(-1, row)[stored]
    v_cache.view(-1, row)[slot_mapping[stored]] = value.reshape(-1, row)[stored]


def _gather_kv(rows: Tensor, block_ids: Tensor, seq_len: int, kv_shape) -> Tensor:
    """One request's first seq_len cached tokens -> [1, kv_heads, seq_len, head_dim]. `rows` is
    the cache viewed as one row per block: index_select of whole rows is a plain memcpy per
    block (on the 4-D cache it is ~4x slower on CPU), and only the request's blocks move."""
    return rows.index_select(0, block_ids).view(1, -1, *kv_shape)[:, :seq_len].transpose(1, 2)


def _attend_one(query: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
    """One request's new tokens, query [Q, q_heads, dim], over its cached k, v [1, kv_heads, S, dim]."""
    query_len, seq_len = query.shape[0], k.shape[2]
    num_computed = seq_len - query_len  # cached prefix before this step's tokens
    # 4-D [1, heads, len, dim] on purpose: SDPA sends 3-D inputs to its slow math kernel on CPU.
    q = query[None].transpose(1, 2)  # [1, q_heads, Q, dim]
    if query_len == 1:  # a decode: the one new token sees everything, no mask needed
        mask, causal = None, False
    elif num_computed == 0:
        mask, causal = None, True
    else:
        # SDPA's is_causal aligns the top-left corner; with a prefix, query j sits at position
        # num_computed + j, so the causal edge is shifted right by num_computed.
        k_pos = torch.arange(seq_len, device=query.device)
        mask, causal = k_pos[None, :] <= k_pos[num_computed:, None], False  # [Q, S]
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale,
                                         enable_gqa=True)
    return out[0].transpose(0, 1)


def paged_attention_torch(
    query: Tensor, k_cache: Tensor, v_cache: Tensor, attn_metadata: AttentionMetadata, scale: float
) -> Tensor:
    """Causal attention of query `[num_tokens, q_heads, head_dim]` over the paged cache -> same shape.

    One SDPA per request, each over only its own blocks. Why not one batched call with the
    sequences padded to the longest? On CPU the padded K/V copy costs more than the loop: with
    64 decodes of 64..768 tokens, the loop is ~4x faster, since it never moves padding and each
    request's K/V stays in cache between the copy and the attention.
    """
    out = torch.empty_like(query)
    attend_each(query, out, k_cache, v_cache, attn_metadata, scale, range(attn_metadata.num_reqs))
    return out


def attend_each(query: Tensor, out: Tensor, k_cache: Tensor, v_cache: Tensor,
                attn_metadata: AttentionMetadata, scale: float, requests) -> None:
    """paged_attention_torch's loop, for the request indices in `requests`, into `out`."""
    md = attn_metadata
    qsl, seq_lens = md.query_start_loc.tolist(), md.seq_lens.tolist()  # one sync for all
    # Per-layer work hoisted out of the loop: each op saved here is saved num_reqs times.
    block_size, kv_shape = k_cache.shape[1], k_cache.shape[2:]
    k_rows, v_rows = k_cache.view(k_cache.shape[0], -1), v_cache.view(v_cache.shape[0], -1)
    block_tables = md.block_tables.long()
    for i in requests:
        seq_len = seq_lens[i]
        block_ids = block_tables[i, : -(-seq_len // block_size)]
        k = _gather_kv(k_rows, block_ids, seq_len, kv_shape)
        v = _gather_kv(v_rows, block_ids, seq_len, kv_shape)
        out[qsl[i]:qsl[i + 1]] = _attend_one(query[qsl[i]:qsl[i + 1]], k, v, scale)
