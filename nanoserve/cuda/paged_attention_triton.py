"""Triton kernels for paged attention: the GPU path beside the torch reference in paged_attention.py.

Two kernels, one launch each per layer per step:

  store_kv_triton        writes this step's new K/V rows into the paged cache through slot_mapping.
  paged_attention_triton ONE "unified" kernel for the whole mixed batch: prefill chunks (with or without
                         a prefix already in the cache) and decode rows, read through block tables.

A decode step with too few (request, kv head) programs to fill the GPU runs the split-K form of the
same loop instead (decode_attention_triton.py); cuda/backend.py picks, and compiles every variant at
load (compile_kernels) so that no step waits on a compile.

Cache layout (per layer): k_cache, v_cache [num_blocks, block_size, num_kv_heads, head_dim], and
slot = block_id * block_size + offset. Worked example with block_size 4 and block_table [7, 1, 3]:
position 9 is logical block 9 // 4 = 2 -> physical block 3, offset 9 % 4 = 1 -> slot 3 * 4 + 1 = 13.

The attention kernel, per program = (request, tile of BLOCK_Q of its new tokens, kv head):
  - rows of the tile are (query token, q head) pairs for all q heads that share this kv head (GQA), so
    each K/V tile is loaded once and used by the whole group;
  - walk the request's keys TILE_N at a time (a tile may span several cache blocks: each key looks up
    its own physical block, so any block_size works), with online softmax and fp32 accumulation;
  - causal: query j of a request with seq_len S and query_len Q sits at position S - Q + j and sees
    keys at positions <= its own. Decode is simply Q == 1.

Runs on CUDA, or on CPU tensors under the Triton interpreter (TRITON_INTERPRET=1, set before importing
triton), which is how tests/test_paged_attention_triton.py checks it against dense SDPA:
    TRITON_INTERPRET=1 pytest -q tests/test_paged_attention_triton.py
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

if TYPE_CHECKING:  # type only: the kernels read its tensors, nothing else of it
    from nanoserve.attention_metadata import AttentionMetadata


# ----------------------------------------------------------------------------------------------------
# store: one program per new token


@triton.jit
def _store_kv_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
    stride_kt, stride_kh, stride_kd,  # key [num_tokens, num_kv_heads, head_dim]
    stride_vt, stride_vh, stride_vd,  # value, same shape (strides may differ)
    stride_cb, stride_co, stride_ch, stride_cd,  # cache [num_blocks, block_size, heads, dim]
    stride_vcb, stride_vco, stride_vch, stride_vcd,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,  # fixed per model
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,  # the above rounded up to powers of two
):
    token = tl.program_id(0).to(tl.int64)  # token * stride_kt in int64, like every offset below
    slot = tl.load(slot_mapping_ptr + token)  # int64: block_id * stride_cb too
    if slot < 0:  # no slot for this token: nothing to store
        return
    block_id = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (h < NUM_KV_HEADS) & (d < HEAD_DIM)
    k = tl.load(key_ptr + token * stride_kt + h * stride_kh + d * stride_kd, mask=mask)
    v = tl.load(value_ptr + token * stride_vt + h * stride_vh + d * stride_vd, mask=mask)
    tl.store(k_cache_ptr + block_id * stride_cb + offset * stride_co + h * stride_ch + d * stride_cd,
             k, mask=mask)
    tl.store(v_cache_ptr + block_id * stride_vcb + offset * stride_vco + h * stride_vch + d * stride_vcd,
             v, mask=mask)


def store_kv_triton(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write key/value [num_tokens, num_kv_heads, head_dim] into the caches at slot_mapping (< 0: skip)."""
    num_tokens, num_kv_heads, head_dim = _check_kv(key, value, k_cache, v_cache)
    if slot_mapping.shape != (num_tokens,) or slot_mapping.dtype != torch.int64 or slot_mapping.device != key.device:
        raise ValueError(f"slot_mapping: expected int64 [{num_tokens}] on {key.device}, got "
                         f"{slot_mapping.dtype} {list(slot_mapping.shape)} on {slot_mapping.device}")
    if num_tokens == 0:
        return
    _store_kv_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping,
        *key.stride(), *value.stride(), *k_cache.stride(), *v_cache.stride(),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, BLOCK_SIZE=k_cache.shape[1],
        BLOCK_H=triton.next_power_of_2(num_kv_heads), BLOCK_D=triton.next_power_of_2(head_dim),
        num_warps=1 if num_kv_heads * head_dim <= 1024 else 4,
    )


# ----------------------------------------------------------------------------------------------------
# attention: one unified kernel for prefill chunks and decode rows


@triton.jit
def _cache_offsets(block_id, k_pos, stride_b, stride_o, BLOCK_SIZE: tl.constexpr):
    """Element offsets of key positions k_pos in a cache, in int64: block_id * stride_b passes 2^31 in
    a cache of more than 2^31 elements (4 GiB of bf16: a big GPU's pool over a model of few layers)."""
    return block_id.to(tl.int64) * stride_b + (k_pos % BLOCK_SIZE) * stride_o


@triton.jit
def _attend_over_cache(
    q, q_pos, kv_start, kv_end, req, kv_head, d, d_valid, scale,
    k_cache_ptr, v_cache_ptr, block_tables_ptr, stride_bt,
    stride_kb, stride_ko, stride_kh, stride_kd, stride_vb, stride_vo, stride_vh, stride_vd,
    BLOCK_SIZE: tl.constexpr, ROWS: tl.constexpr, TILE_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Online softmax of the q tile's rows over keys [kv_start, kv_end), TILE_N at a time, in fp32:
    returns (sum of p * V, sum of p, max score) per row. kv_start is 0 but in a split-K segment
    (decode_attention_triton.py); kv_end - kv_start <= 0 leaves (0, 0, -inf)."""
    m_i = tl.full([ROWS], float("-inf"), tl.float32)  # running max of the scores
    l_i = tl.zeros([ROWS], tl.float32)  # running softmax denominator
    acc = tl.zeros([ROWS, BLOCK_D], tl.float32)
    n = tl.arange(0, TILE_N)
    for tile_start in range(kv_start, kv_end, TILE_N):
        k_pos = tile_start + n
        k_valid = k_pos < kv_end
        # Each key finds its own physical block, so a tile may straddle cache blocks.
        block_id = tl.load(block_tables_ptr + req * stride_bt + k_pos // BLOCK_SIZE, mask=k_valid, other=0)
        k_offs = (_cache_offsets(block_id, k_pos, stride_kb, stride_ko, BLOCK_SIZE)[None, :]
                  + kv_head * stride_kh + d[:, None] * stride_kd)
        k = tl.load(k_cache_ptr + k_offs, mask=k_valid[None, :] & d_valid[:, None], other=0.0)  # [D, N]
        v_offs = (_cache_offsets(block_id, k_pos, stride_vb, stride_vo, BLOCK_SIZE)[:, None]
                  + kv_head * stride_vh + d[None, :] * stride_vd)
        v = tl.load(v_cache_ptr + v_offs, mask=k_valid[:, None] & d_valid[None, :], other=0.0)  # [N, D]

        # "ieee" keeps float32 exact on GPUs (the default would round to tf32); ignored for fp16/bf16.
        s = tl.dot(q, k, input_precision="ieee") * scale
        s = tl.where((k_pos[None, :] <= q_pos[:, None]) & k_valid[None, :], s, float("-inf"))
        # The first key (position 0, or a segment's first) is visible to every row, so after the
        # first tile m_new is finite and exp(-inf - finite) = 0 never produces NaN.
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)  # rescales what was accumulated under the old max
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _unified_attention_kernel(
    out_ptr, q_ptr, k_cache_ptr, v_cache_ptr,
    block_tables_ptr, seq_lens_ptr, query_start_loc_ptr,
    scale,
    stride_qt, stride_qh, stride_qd,  # query [num_tokens, num_q_heads, head_dim]
    stride_ot, stride_oh, stride_od,  # out, same shape
    stride_kb, stride_ko, stride_kh, stride_kd,  # k_cache [num_blocks, block_size, heads, dim]
    stride_vb, stride_vo, stride_vh, stride_vd,
    stride_bt,  # block_tables row stride
    HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,  # fixed per model: one compile, divisions become shifts
    NUM_QUERIES_PER_KV: tl.constexpr,  # GQA group size G = num_q_heads // num_kv_heads
    G_PAD: tl.constexpr,  # G rounded up to a power of two (tl.arange needs one)
    BLOCK_Q: tl.constexpr,  # query tokens per program; BLOCK_Q * G_PAD rows per tile
    TILE_N: tl.constexpr,  # keys per loop iteration
    BLOCK_D: tl.constexpr,  # head_dim rounded up to a power of two (>= 16 for tl.dot)
):
    req = tl.program_id(0)
    q_tile = tl.program_id(1)
    kv_head = tl.program_id(2)

    q_start = tl.load(query_start_loc_ptr + req)
    query_len = tl.load(query_start_loc_ptr + req + 1) - q_start
    # The grid is sized for the longest query in the batch; shorter requests' extra tiles exit here.
    if q_tile * BLOCK_Q >= query_len:
        return
    context_len = tl.load(seq_lens_ptr + req) - query_len  # tokens cached before this step

    # Row m of the tile = query token q_tile * BLOCK_Q + m // G_PAD, q head kv_head * G + m % G_PAD.
    m = tl.arange(0, BLOCK_Q * G_PAD)
    q_idx = q_tile * BLOCK_Q + m // G_PAD
    q_head = kv_head * NUM_QUERIES_PER_KV + m % G_PAD
    d = tl.arange(0, BLOCK_D)
    d_valid = d < HEAD_DIM
    mask = ((q_idx < query_len) & (m % G_PAD < NUM_QUERIES_PER_KV))[:, None] & d_valid[None, :]
    token = (q_start + q_idx).to(tl.int64)
    q = tl.load(q_ptr + (token * stride_qt + q_head * stride_qh)[:, None] + d[None, :] * stride_qd,
                mask=mask, other=0.0)

    # Causal: query j sits at position context_len + j; the tile's last token sees keys up to its own.
    kv_end = context_len + tl.minimum(query_len, (q_tile + 1) * BLOCK_Q)
    acc, l_i, _ = _attend_over_cache(
        q, context_len + q_idx, 0, kv_end, req, kv_head, d, d_valid, scale,
        k_cache_ptr, v_cache_ptr, block_tables_ptr, stride_bt,
        stride_kb, stride_ko, stride_kh, stride_kd, stride_vb, stride_vo, stride_vh, stride_vd,
        BLOCK_SIZE, BLOCK_Q * G_PAD, TILE_N, BLOCK_D)
    o_offs = (token * stride_ot + q_head * stride_oh)[:, None] + d[None, :] * stride_od
    tl.store(out_ptr + o_offs, (acc / l_i[:, None]).to(out_ptr.dtype.element_ty), mask=mask)


def paged_attention_triton(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           attn_metadata: AttentionMetadata, scale: float) -> torch.Tensor:
    """Causal attention of query [num_tokens, num_q_heads, head_dim] over each request's cached sequence.

    The new tokens' K/V must already be in the cache (store_kv_triton). Returns [num_tokens, num_q_heads,
    head_dim] in query's dtype.
    """
    _check_attention(query, k_cache, v_cache, attn_metadata)
    num_tokens, num_q_heads, head_dim = query.shape
    num_kv_heads, md, num_reqs = k_cache.shape[2], attn_metadata, attn_metadata.seq_lens.shape[0]
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)  # contiguous even if query is a view
    if num_tokens == 0 or num_reqs == 0:
        return out
    group = num_q_heads // num_kv_heads
    g_pad = triton.next_power_of_2(group)
    # tl.dot wants >= 16 rows; prefill tiles are bigger so each K/V tile is reused by more queries.
    # max_query_len == 1 is a pure-decode batch: one token per program, rows padded up to 16.
    block_m = max(16 if md.max_query_len <= 1 else 64, g_pad)
    block_q = block_m // g_pad
    block_d = max(16, triton.next_power_of_2(head_dim))
    grid = (num_reqs, triton.cdiv(md.max_query_len, block_q), num_kv_heads)
    _unified_attention_kernel[grid](
        out, query, k_cache, v_cache,
        md.block_tables, md.seq_lens, md.query_start_loc,
        scale,
        *query.stride(), *out.stride(), *k_cache.stride(), *v_cache.stride(),
        md.block_tables.stride(0),
        HEAD_DIM=head_dim, BLOCK_SIZE=k_cache.shape[1],
        NUM_QUERIES_PER_KV=group, G_PAD=g_pad, BLOCK_Q=block_q, TILE_N=32, BLOCK_D=block_d,
        num_warps=4 if block_m * block_d <= 64 * 64 else 8,
    )
    return out


# ----------------------------------------------------------------------------------------------------
# input checks (shapes, dtypes and devices only: no device sync on the hot path)


def _check_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     md: AttentionMetadata) -> None:
    """Both attention launchers' checks (this file's and decode_attention_triton.py's)."""
    if query.dim() != 3:
        raise ValueError(f"query: expected [num_tokens, num_q_heads, head_dim], got {tuple(query.shape)}")
    _, num_q_heads, head_dim = query.shape
    _check_cache(k_cache, v_cache, query.dtype, query.device)
    num_kv_heads = k_cache.shape[2]
    if k_cache.shape[3] != head_dim:
        raise ValueError(f"k_cache: head_dim {k_cache.shape[3]} != query head_dim {head_dim}")
    if num_q_heads % num_kv_heads:
        raise ValueError(f"query: num_q_heads {num_q_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    num_reqs = md.seq_lens.shape[0]
    if md.query_start_loc.shape != (num_reqs + 1,):
        raise ValueError(f"query_start_loc: expected shape ({num_reqs + 1},), got {tuple(md.query_start_loc.shape)}")
    if md.block_tables.dim() != 2 or md.block_tables.shape[0] != num_reqs:
        raise ValueError(f"block_tables: expected [{num_reqs}, max_blocks_per_req], got {tuple(md.block_tables.shape)}")
    for name in ("block_tables", "seq_lens", "query_start_loc"):
        t = getattr(md, name)
        if t.dtype != torch.int32 or t.device != query.device:
            raise ValueError(f"{name}: expected int32 on {query.device}, got {t.dtype} on {t.device}")
        if t.stride(-1) != 1:  # the kernel indexes these with unit stride
            raise ValueError(f"{name}: last dimension must be contiguous")


def _check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor, dtype: torch.dtype, device: torch.device) -> None:
    if k_cache.dim() != 4:
        raise ValueError(f"k_cache: expected [num_blocks, block_size, num_kv_heads, head_dim], "
                         f"got {tuple(k_cache.shape)}")
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache: shape {tuple(v_cache.shape)} != k_cache shape {tuple(k_cache.shape)}")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.dtype != dtype or t.device != device:
            raise ValueError(f"{name}: expected {dtype} on {device}, got {t.dtype} on {t.device}")


def _check_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
              v_cache: torch.Tensor) -> tuple[int, int, int]:
    if key.dim() != 3:
        raise ValueError(f"key: expected [num_tokens, num_kv_heads, head_dim], got {tuple(key.shape)}")
    if value.shape != key.shape:
        raise ValueError(f"value: shape {tuple(value.shape)} != key shape {tuple(key.shape)}")
    _check_cache(k_cache, v_cache, key.dtype, key.device)
    if value.dtype != key.dtype:
        raise ValueError(f"value: dtype {value.dtype} != key dtype {key.dtype}")
    if k_cache.shape[2:] != key.shape[1:]:
        raise ValueError(f"key: [num_kv_heads, head_dim] {tuple(key.shape[1:])} does not match "
                         f"k_cache {tuple(k_cache.shape[2:])}")
    return key.shape
