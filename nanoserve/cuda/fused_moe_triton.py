"""fused_moe_triton.py: FusedMoE (layers.py) on the GPU, vLLM's fused MoE: one grouped GEMM kernel
launched twice (w13, then w2), silu·mul between.

  moe_align_block_size  the (token, expert) pairs sorted by expert, each expert's run padded to a
                        multiple of BLOCK_SIZE_M, so that every block of rows is one expert's.
                        Torch ops of fixed shapes, no sync: a CUDA graph replays them.
  _fused_moe_kernel     a grouped GEMM over those rows: a program multiplies one block of them
                        (gathered from their tokens' rows) by one BLOCK_SIZE_N tile of that
                        expert's weight; int8 / fp8 weights widened in registers and each output
                        channel scaled after the sums; a block of an expert held elsewhere
                        (expert id -1) writes zeros; w2's launch also scales each row by its pair's
                        router weight.
  fused_moe_triton      FusedMoE.forward: the router (op.route), the alignment, hidden -> w13 -> [pairs,
                        2I], silu_and_mul_triton (activation_triton.py) -> [pairs, I], -> w2 ->
                        [pairs, H], and each token's k rows summed.

A pair is token * top_k + slot. Example, 2 tokens, top-2, ids [[2, 0], [2, 1]], BLOCK_SIZE_M 4:
expert 0 has pair 1, expert 1 pair 3, expert 2 pairs 0 and 2, so sorted_token_ids is
[1 4 4 4 | 3 4 4 4 | 0 2 4 4] (4, the number of pairs: a padding row, masked), expert_ids per
block [0 1 2], num_tokens_post_padded [12].

The sums are float32 (fp32 products in IEEE precision, not TF32), rounded to the model dtype where
forward_native rounds: after each product and after silu, the k rows summed by torch.sum. The
router weight multiplies w2's float32 sums before their rounding (forward_native: after), and a
quantized weight is scaled after the sums (forward_native dequantizes it first): within a rounding.

    TRITON_INTERPRET=1 pytest -q tests/test_fused_moe.py -k triton     # on CPU, == forward_native
    python scripts/gpu_smoke.py fused-moe                              # on a GPU, at real shapes
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from nanoserve.cuda.activation_triton import silu_and_mul_triton
from nanoserve.layers import FusedMoE


def moe_config(tokens: int, num_experts: int) -> dict[str, int]:
    """vLLM's default tiles (fused_moe.get_default_config): while there are no more tokens than
    experts, each expert gets a few rows, so blocks of 16; above, blocks of 64, grouped by 8 for
    L2 reuse of the weight tiles."""
    if tokens <= num_experts:
        return dict(BLOCK_SIZE_M=16, BLOCK_SIZE_N=32, BLOCK_SIZE_K=64, GROUP_SIZE_M=1)
    return dict(BLOCK_SIZE_M=64, BLOCK_SIZE_N=64, BLOCK_SIZE_K=32, GROUP_SIZE_M=8)


def expert_map(op: FusedMoE) -> Tensor:
    """Global expert id -> the index of its weights on this rank, or -1 (held elsewhere)."""
    device = op.w13_weight.device
    local = torch.full((op.num_experts,), -1, dtype=torch.int32, device=device)
    local[op.expert_ids] = torch.arange(len(op.expert_ids), dtype=torch.int32, device=device)
    return local


def moe_align_block_size(topk_ids: Tensor, block_size: int, expert_map: Tensor
                         ) -> tuple[Tensor, Tensor, Tensor]:
    """topk_ids [tokens, k] (global ids) -> (sorted_token_ids [at most pairs + min(E, pairs) *
    (block_size - 1)] int32: the pairs by expert, each expert's run padded with `pairs`;
    expert_ids [one per block] int32: its local expert or -1; num_tokens_post_padded [1] int32).
    Blocks past num_tokens_post_padded are never read (the kernel's programs there return)."""
    num_experts, pairs, device = expert_map.shape[0], topk_ids.numel(), topk_ids.device
    flat = topk_ids.flatten()
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device).scatter_add_(
        0, flat, torch.ones_like(flat))     # bincount's length would need a sync
    padded = (counts + block_size - 1) // block_size * block_size
    ends = padded.cumsum(0)
    order = flat.argsort(stable=True)     # pairs by expert, ascending within one
    expert = flat[order]
    rank = torch.arange(pairs, device=device) - (counts.cumsum(0) - counts)[expert]   # within its expert
    sorted_token_ids = torch.full((pairs + min(num_experts, pairs) * (block_size - 1),), pairs,
                                  dtype=torch.int32, device=device)
    sorted_token_ids.scatter_(0, (ends - padded)[expert] + rank, order.to(torch.int32))
    block_starts = torch.arange(triton.cdiv(sorted_token_ids.shape[0], block_size), device=device) * block_size
    block_expert = torch.searchsorted(ends, block_starts, right=True).clamp_(max=num_experts - 1)
    return sorted_token_ids, expert_map[block_expert], ends[-1:].to(torch.int32)


@triton.jit(do_not_specialize=["EM", "num_valid_tokens"])   # they change with the tokens: no recompile
def _fused_moe_kernel(a_ptr, b_ptr, c_ptr, b_scale_ptr, topk_weights_ptr, sorted_token_ids_ptr,
                      expert_ids_ptr, num_tokens_post_padded_ptr, N, K, EM, num_valid_tokens,
                      stride_am, stride_ak, stride_be, stride_bn, stride_bk, stride_cm, stride_cn,
                      BLOCK_SIZE_M: tl.constexpr, BLOCK_SIZE_N: tl.constexpr, BLOCK_SIZE_K: tl.constexpr,
                      GROUP_SIZE_M: tl.constexpr, TOP_K: tl.constexpr, MUL_ROUTED_WEIGHT: tl.constexpr,
                      PER_CHANNEL_SCALE: tl.constexpr):
    """C[pair] = A[pair // TOP_K] @ B[expert].T (B [E, N, K]) for one block of sorted rows and one
    tile of N; * scale[expert, n] (PER_CHANNEL_SCALE), * topk_weights[pair] (MUL_ROUTED_WEIGHT)."""
    pid = tl.program_id(0)
    num_pid_m, num_pid_n = tl.cdiv(EM, BLOCK_SIZE_M), tl.cdiv(N, BLOCK_SIZE_N)
    group = pid // (GROUP_SIZE_M * num_pid_n)     # GROUP_SIZE_M row blocks share a weight tile in L2
    first_m = group * GROUP_SIZE_M
    group_size = min(num_pid_m - first_m, GROUP_SIZE_M)
    pid_m = first_m + (pid % (GROUP_SIZE_M * num_pid_n)) % group_size
    pid_n = (pid % (GROUP_SIZE_M * num_pid_n)) // group_size
    if pid_m * BLOCK_SIZE_M >= tl.load(num_tokens_post_padded_ptr):
        return
    offs_token = tl.load(sorted_token_ids_ptr + pid_m * BLOCK_SIZE_M + tl.arange(0, BLOCK_SIZE_M)).to(tl.int64)
    token_mask = offs_token < num_valid_tokens
    offs_cn = pid_n * BLOCK_SIZE_N + tl.arange(0, BLOCK_SIZE_N)
    c_ptrs = c_ptr + offs_token[:, None] * stride_cm + offs_cn[None, :] * stride_cn
    c_mask = token_mask[:, None] & (offs_cn[None, :] < N)
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    if expert == -1:    # held on another rank: these pairs add nothing here
        tl.store(c_ptrs, tl.zeros([BLOCK_SIZE_M, BLOCK_SIZE_N], c_ptr.dtype.element_ty), mask=c_mask)
        return
    offs_k = tl.arange(0, BLOCK_SIZE_K)
    a_ptrs = a_ptr + (offs_token[:, None] // TOP_K) * stride_am + offs_k[None, :] * stride_ak
    offs_bn = offs_cn % N     # the last tile's columns past N wrap (their sums are masked)
    b_ptrs = b_ptr + expert * stride_be + offs_k[:, None] * stride_bk + offs_bn[None, :] * stride_bn
    acc = tl.zeros([BLOCK_SIZE_M, BLOCK_SIZE_N], dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_SIZE_K)):
        k_mask = offs_k < K - k * BLOCK_SIZE_K
        a = tl.load(a_ptrs, mask=token_mask[:, None] & k_mask[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_mask[:, None], other=0.0)
        acc = tl.dot(a, b.to(a.dtype), acc=acc, input_precision="ieee")   # int8 / fp8: exact widening
        a_ptrs += BLOCK_SIZE_K * stride_ak
        b_ptrs += BLOCK_SIZE_K * stride_bk
    if PER_CHANNEL_SCALE:
        acc *= tl.load(b_scale_ptr + expert * N + offs_cn, mask=offs_cn < N, other=0.0)[None, :]
    if MUL_ROUTED_WEIGHT:
        acc *= tl.load(topk_weights_ptr + offs_token, mask=token_mask, other=0.0)[:, None]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=c_mask)


def invoke_fused_moe_kernel(a: Tensor, b: Tensor, b_scale: Optional[Tensor], c: Tensor, topk_weights: Tensor,
                            aligned: tuple[Tensor, Tensor, Tensor], top_k: int, mul_routed_weight: bool,
                            config: dict[str, int]) -> None:
    """c [pairs, N] = the kernel over a [rows, K] and b [E, N, K] (b_scale [E, N] float32 where b is
    quantized), for the pairs moe_align_block_size sorted (`aligned`)."""
    sorted_token_ids, expert_ids, num_tokens_post_padded = aligned
    (_, n, k), em = b.shape, sorted_token_ids.shape[0]
    grid = (triton.cdiv(em, config["BLOCK_SIZE_M"]) * triton.cdiv(n, config["BLOCK_SIZE_N"]),)
    _fused_moe_kernel[grid](
        a, b, c, topk_weights if b_scale is None else b_scale, topk_weights, sorted_token_ids, expert_ids,
        num_tokens_post_padded, n, k, em, topk_weights.numel(), a.stride(0), a.stride(1), b.stride(0),
        b.stride(1), b.stride(2), c.stride(0), c.stride(1), TOP_K=top_k, MUL_ROUTED_WEIGHT=mul_routed_weight,
        PER_CHANNEL_SCALE=b_scale is not None, num_warps=4, **config)


def fused_moe_triton(op: FusedMoE, local_of: Tensor, hidden: Tensor, router_logits: Tensor) -> Tensor:
    """FusedMoE.forward: hidden [tokens, H], router_logits [tokens, E] -> [tokens, H]. local_of:
    expert_map(op), built once at bind."""
    topk_weights, topk_ids = op.route(router_logits)
    tokens, top_k = topk_ids.shape
    config = moe_config(tokens, op.num_experts)
    aligned = moe_align_block_size(topk_ids, config["BLOCK_SIZE_M"], local_of)
    scales = ((op.w13_weight_scale, op.w2_weight_scale) if op.quantization else (None, None))
    gate_up = hidden.new_empty(tokens * top_k, op.w13_weight.shape[1])
    invoke_fused_moe_kernel(hidden, op.w13_weight, scales[0], gate_up, topk_weights, aligned, top_k, False, config)
    down = hidden.new_empty(tokens * top_k, hidden.shape[1])
    invoke_fused_moe_kernel(silu_and_mul_triton(gate_up), op.w2_weight, scales[1], down, topk_weights,
                            aligned, 1, True, config)
    return down.view(tokens, top_k, -1).sum(dim=1)
