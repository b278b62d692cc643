"""decode_attention_triton.py: decode attention split over the sequence (split-K, flash-decoding),
for the steps where the unified kernel (paged_attention_triton.py) leaves the GPU idle.

Why: the unified kernel runs one program per (request, kv head) in a decode step. At batch 1 on
SmolLM2-135M that is 3 programs on a GPU of 132 SMs, each walking its whole sequence alone. Here
each sequence is cut into NUM_SEGMENTS segments, one program per (request, kv head, segment), as
vLLM's triton_unified_attention does for decode (its 3D path):

  _split_kv_decode_kernel   per segment, the same online softmax as the unified kernel
                            (_attend_over_cache over keys [start, end)), its partial max, sum and
                            unnormalised output written to float32 scratch;
  _reduce_segments_kernel   per (request, q head), the segments merged: with M the largest max,
                            out = sum_s exp(m_s - M) acc_s / sum_s exp(m_s - M) l_s.

Example: seq_len 1000, TILE_N 32, 16 segments: each covers ceil(1000 / (16 * 32)) = 2 tiles = 64
keys; segments 0..15 cover [0, 64), ..., [960, 1000). seq_len 5: segment 0 covers [0, 5), the
other 15 are empty (their programs return; the reduce reads only the used ones).

CUDA-graph safe: the grid (requests, kv heads, NUM_SEGMENTS) and the scratch come from shapes, never
from seq_lens' values (which a replay changes without the host seeing them); a segment's length is
computed on the device. `uses_split_kv` decides from shapes too: a decode-only step (max_query_len
1) with fewer than MIN_PROGRAMS (request, kv head) pairs. Padded rows (query_len 0) do nothing.

    TRITON_INTERPRET=1 pytest -q tests/test_paged_attention_triton.py -k split_kv
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from nanoserve.cuda.paged_attention_triton import _attend_over_cache, _check_attention

if TYPE_CHECKING:
    from nanoserve.attention_metadata import AttentionMetadata

NUM_SEGMENTS = 16   # vLLM's NUM_SEGMENTS_PER_SEQ: segments a sequence is split into
MIN_PROGRAMS = 128  # below this many (request, kv head) programs, split (vLLM: 128 // kv heads)
TILE_N = 32         # keys a loop iteration, as the unified kernel's; a segment is whole tiles


def uses_split_kv(max_query_len: int, num_reqs: int, num_kv_heads: int) -> bool:
    """Whether a step's attention runs split-K: decode-only and too few programs otherwise."""
    return max_query_len == 1 and num_reqs * num_kv_heads < MIN_PROGRAMS


@triton.jit
def _segment_len(seq_len, NUM_SEGMENTS: tl.constexpr, TILE_N: tl.constexpr):
    """Keys per segment: the fewest whole tiles that cover seq_len in NUM_SEGMENTS segments."""
    return tl.cdiv(seq_len, NUM_SEGMENTS * TILE_N) * TILE_N


@triton.jit
def _split_kv_decode_kernel(
    segm_acc_ptr, segm_max_ptr, segm_sum_ptr,  # scratch [reqs, q heads, NUM_SEGMENTS(, BLOCK_D)]
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, query_start_loc_ptr, scale,
    stride_qt, stride_qh, stride_qd,
    stride_kb, stride_ko, stride_kh, stride_kd, stride_vb, stride_vo, stride_vh, stride_vd,
    stride_bt,
    HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, NUM_Q_HEADS: tl.constexpr,
    NUM_QUERIES_PER_KV: tl.constexpr, ROWS: tl.constexpr, TILE_N: tl.constexpr,
    BLOCK_D: tl.constexpr, NUM_SEGMENTS: tl.constexpr,
):
    req, kv_head, segment = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + req)
    if tl.load(query_start_loc_ptr + req + 1) == q_start:  # a padded row: no query token
        return
    seq_len = tl.load(seq_lens_ptr + req)
    kv_start = segment * _segment_len(seq_len, NUM_SEGMENTS, TILE_N)
    if kv_start >= seq_len:  # past a short sequence's end: the reduce skips this segment
        return
    kv_end = tl.minimum(kv_start + _segment_len(seq_len, NUM_SEGMENTS, TILE_N), seq_len)

    # Rows: the q heads of this kv head (GQA), padded to ROWS >= 16 for tl.dot.
    m = tl.arange(0, ROWS)
    q_head = kv_head * NUM_QUERIES_PER_KV + m
    d = tl.arange(0, BLOCK_D)
    d_valid = d < HEAD_DIM
    row_valid = m < NUM_QUERIES_PER_KV
    q = tl.load(q_ptr + q_start.to(tl.int64) * stride_qt + (q_head * stride_qh)[:, None]
                + d[None, :] * stride_qd, mask=row_valid[:, None] & d_valid[None, :], other=0.0)
    # The one query token sits at position seq_len - 1: every key of the segment is visible.
    acc, l_i, m_i = _attend_over_cache(
        q, tl.full([ROWS], 0, tl.int32) + seq_len - 1, kv_start, kv_end, req, kv_head, d, d_valid,
        scale, k_cache_ptr, v_cache_ptr, block_tables_ptr, stride_bt,
        stride_kb, stride_ko, stride_kh, stride_kd, stride_vb, stride_vo, stride_vh, stride_vd,
        BLOCK_SIZE, ROWS, TILE_N, BLOCK_D)
    at = (req * NUM_Q_HEADS + q_head) * NUM_SEGMENTS + segment  # [ROWS] scratch index
    tl.store(segm_max_ptr + at, m_i, mask=row_valid)
    tl.store(segm_sum_ptr + at, l_i, mask=row_valid)
    tl.store(segm_acc_ptr + at.to(tl.int64)[:, None] * BLOCK_D + d[None, :], acc,
             mask=row_valid[:, None])


@triton.jit
def _reduce_segments_kernel(
    out_ptr, segm_acc_ptr, segm_max_ptr, segm_sum_ptr, seq_lens_ptr, query_start_loc_ptr,
    stride_ot, stride_oh, stride_od,
    HEAD_DIM: tl.constexpr, NUM_Q_HEADS: tl.constexpr, TILE_N: tl.constexpr,
    BLOCK_D: tl.constexpr, NUM_SEGMENTS: tl.constexpr,
):
    req, q_head = tl.program_id(0), tl.program_id(1)
    q_start = tl.load(query_start_loc_ptr + req)
    if tl.load(query_start_loc_ptr + req + 1) == q_start:
        return
    seq_len = tl.load(seq_lens_ptr + req)
    s = tl.arange(0, NUM_SEGMENTS)
    used = s * _segment_len(seq_len, NUM_SEGMENTS, TILE_N) < seq_len  # segments with keys
    at = (req * NUM_Q_HEADS + q_head) * NUM_SEGMENTS + s
    m_s = tl.load(segm_max_ptr + at, mask=used, other=float("-inf"))
    weight = tl.exp(m_s - tl.max(m_s, axis=0))  # segment 0 is always used: the max is finite
    l_sum = tl.sum(tl.load(segm_sum_ptr + at, mask=used, other=0.0) * weight, axis=0)
    d = tl.arange(0, BLOCK_D)
    acc = tl.load(segm_acc_ptr + at.to(tl.int64)[:, None] * BLOCK_D + d[None, :],
                  mask=used[:, None], other=0.0)
    out = tl.sum(acc * weight[:, None], axis=0) / l_sum
    tl.store(out_ptr + q_start.to(tl.int64) * stride_ot + q_head * stride_oh + d * stride_od,
             out.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


def split_kv_decode_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                              attn_metadata: AttentionMetadata, scale: float) -> torch.Tensor:
    """paged_attention_triton's contract for a decode-only step (one query token a request, or
    none: a padded row), in two launches: the segments, then their reduction."""
    _check_attention(query, k_cache, v_cache, attn_metadata)
    md, (num_tokens, num_q_heads, head_dim) = attn_metadata, query.shape
    num_reqs, num_kv_heads = md.seq_lens.shape[0], k_cache.shape[2]
    if md.max_query_len != 1:
        raise ValueError(f"split-K attention is for decode-only steps (max_query_len 1), got "
                         f"{md.max_query_len}")
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if num_tokens == 0 or num_reqs == 0:
        return out
    group = num_q_heads // num_kv_heads
    block_d = max(16, triton.next_power_of_2(head_dim))
    # Scratch sized from shapes: allocated inside a graph capture, it is the graph pool's.
    segm_max = torch.empty(num_reqs, num_q_heads, NUM_SEGMENTS, dtype=torch.float32,
                           device=query.device)
    segm_sum, segm_acc = torch.empty_like(segm_max), segm_max.new_empty(*segm_max.shape, block_d)
    _split_kv_decode_kernel[(num_reqs, num_kv_heads, NUM_SEGMENTS)](
        segm_acc, segm_max, segm_sum, query, k_cache, v_cache,
        md.block_tables, md.seq_lens, md.query_start_loc, scale,
        *query.stride(), *k_cache.stride(), *v_cache.stride(), md.block_tables.stride(0),
        HEAD_DIM=head_dim, BLOCK_SIZE=k_cache.shape[1], NUM_Q_HEADS=num_q_heads,
        NUM_QUERIES_PER_KV=group, ROWS=max(16, triton.next_power_of_2(group)), TILE_N=TILE_N,
        BLOCK_D=block_d, NUM_SEGMENTS=NUM_SEGMENTS, num_warps=4)
    _reduce_segments_kernel[(num_reqs, num_q_heads)](
        out, segm_acc, segm_max, segm_sum, md.seq_lens, md.query_start_loc, *out.stride(),
        HEAD_DIM=head_dim, NUM_Q_HEADS=num_q_heads, TILE_N=TILE_N, BLOCK_D=block_d,
        NUM_SEGMENTS=NUM_SEGMENTS, num_warps=1 if block_d <= 64 else 2)
    return out
