"""backend.py: the CUDA backend: the ops of layers.py as Triton kernels, each one launch: RMSNorm
with its residual add, RoPE with the K/V store (norm_rope_triton.py), silu·mul
(activation_triton.py) and attention over the paged cache (paged_attention_triton.py's unified
kernel, or decode_attention_triton.py's split-K for a decode step of few requests); FusedMoE as
vLLM's fused MoE (fused_moe_triton.py: a grouped GEMM over the tokens sorted by expert); the products
on cuBLAS, fp8 ones on torch._scaled_mm where the GPU has them, their activations quantized by one
kernel (quantized.py). Decode-only steps replay CUDA graphs of the model (graphs.py,
graph_capture.py).

    TRITON_INTERPRET=1 pytest -q tests/test_triton_ops.py tests/test_paged_attention_triton.py
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

import torch
from torch import Tensor

from nanoserve.attention_metadata import AttentionMetadata
from nanoserve.config import Config
from nanoserve.cuda.activation_triton import per_token_quant_fp8_triton, silu_and_mul_triton
from nanoserve.cuda.decode_attention_triton import split_kv_decode_attention, uses_split_kv
from nanoserve.cuda.fused_moe_triton import expert_map, fused_moe_triton
from nanoserve.cuda.graphs import CUDAGraph
from nanoserve.cuda.norm_rope_triton import rms_norm_triton, rope_store_kv_triton
from nanoserve.cuda.paged_attention_triton import paged_attention_triton
from nanoserve.cuda.quantized import scaled_mm_linear, uses_scaled_mm
from nanoserve.graph_capture import GraphWrapper
from nanoserve.layers import (Attention, Backend, FusedMoE, Linear, RMSNorm, RopeStoreKV,
                              SiluAndMul, gemm_label, model_dtype)


def rms_norm(op: RMSNorm, x: Tensor, residual: Tensor | None = None):
    """RMSNorm.forward: the residual add and the norm in one launch."""
    return rms_norm_triton(op.weight, op.eps, x, residual)


def rope_store_kv(rope, q: Tensor, k: Tensor, v: Tensor, kv_cache, slot_mapping: Tensor) -> Tensor:
    """RopeStoreKV.forward: one launch rotates q and k and stores the rotated k and v."""
    return rope_store_kv_triton(*rope, q, k, v, *kv_cache, slot_mapping)


def attention(op: Attention, q: Tensor, kv_cache, attn_metadata) -> Tensor:
    """Attention.forward: split-K when a decode step has too few (request, kv head) programs to
    fill the GPU, else one unified launch for the whole mixed batch. Decided from shapes only,
    so a captured graph replays the same kernels."""
    md = attn_metadata
    if uses_split_kv(md.max_query_len, md.seq_lens.shape[0], kv_cache[0].shape[2]):
        return split_kv_decode_attention(q, *kv_cache, md, op.scale)
    return paged_attention_triton(q, *kv_cache, md, op.scale)


def bind(model, config: Config, gemm_paths: dict[str, str]) -> Backend:
    """The Triton forms for `model`'s ops, found by type, every kernel variant compiled now
    (compile_kernels, compile_row_ops), so that no step of serving stalls on a compile nor a graph
    capture meets one; fp8 Linears on torch._scaled_mm where the GPU multiplies fp8
    (quantized.py); the forward wrapped for CUDA graphs of decode steps (graphs.py), which the
    runner captures once its KV cache exists, at one rank only (graph_capture.py says why)."""
    device, dtype = next(model.parameters()).device, model_dtype(model)
    capability = torch.cuda.get_device_capability(device)
    for module in model.modules():
        if isinstance(module, Linear) and uses_scaled_mm(module, capability, dtype):
            module.impl = functools.partial(scaled_mm_linear, module,
                                            quantize_rows=per_token_quant_fp8_triton)
            gemm_paths[gemm_label(module, module.weight.dtype)] = "scaled_mm"
        elif isinstance(module, RMSNorm):
            module.impl = functools.partial(rms_norm, module)
        elif isinstance(module, SiluAndMul):
            module.impl = silu_and_mul_triton
        elif isinstance(module, RopeStoreKV):
            module.impl = rope_store_kv
        elif isinstance(module, Attention):
            module.impl = functools.partial(attention, module)
        elif isinstance(module, FusedMoE):
            module.impl = functools.partial(fused_moe_triton, module, expert_map(module))
    attn = next(m for m in model.modules() if isinstance(m, Attention))   # this rank's sizes
    compile_kernels(attn.num_heads, attn.num_kv_heads, attn.head_size, config.block_size, dtype, device)
    compile_row_ops(model, attn, config.block_size, device)
    sizes = config.cudagraph_capture_sizes if config.tensor_parallel_size == 1 else []
    if not sizes:
        return Backend("cuda", model, gemm_paths=gemm_paths)
    graphs = GraphWrapper(model, sizes, CUDAGraph)
    return Backend("cuda", graphs, gemm_paths=gemm_paths, cudagraph_capture_sizes=sizes,
                   capture=graphs.capture)


def compile_kernels(num_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
                    dtype: torch.dtype, device: torch.device) -> None:
    """Run every variant of the RoPE-store and attention kernels that serving meets once, on tiny
    inputs of the model's shapes (this rank's head counts under tensor parallel), so that Triton
    compiles each at start-up instead of stalling a step 1-2 s. Triton compiles one kernel per
    set of constexprs (here BLOCK_Q: a pure-decode step or not) and per integer argument that is
    1, a multiple of 16, or neither; the one that changes between steps is the block-table row
    stride, which is the longest table of the step; and a decode step runs split-K or unified
    by its size (attention)."""
    for name, value in (("num_heads", num_heads), ("num_kv_heads", num_kv_heads),
                        ("head_dim", head_dim), ("block_size", block_size)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer (got {value!r})")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    zeros = functools.partial(torch.zeros, dtype=dtype, device=device)
    k_cache, v_cache = (zeros(2, block_size, num_kv_heads, head_dim) for _ in range(2))
    # The model's layout: q, k and v are views of the fused qkv projection's rows.
    q, k, v = zeros(2, num_heads + 2 * num_kv_heads, head_dim).split(
        [num_heads, num_kv_heads, num_kv_heads], dim=1)
    cos = zeros(2, 1, head_dim // 2)
    query = rope_store_kv_triton(cos, cos, q, k, v, k_cache, v_cache, torch.arange(2, device=device))
    ints = functools.partial(torch.tensor, dtype=torch.int32, device=device)
    for width in (1, 2, 16):  # block-table row stride: 1, neither, a multiple of 16
        for query_len in (1, min(2, width * block_size)):  # a pure-decode step, then a mixed one
            step = SimpleNamespace(block_tables=ints([[0] * width]), seq_lens=ints([query_len]),
                                   query_start_loc=ints([0, query_len]), max_query_len=query_len)
            paged_attention_triton(query[:query_len], k_cache, v_cache, step, head_dim**-0.5)
            if query_len == 1:  # the same decode step, split-K
                split_kv_decode_attention(query[:1], k_cache, v_cache, step, head_dim**-0.5)


@torch.inference_mode()
def compile_row_ops(model, attn: Attention, block_size: int, device: torch.device) -> None:
    """Each row kernel bound to `model` compiled once, on its own shapes: a prefill of two tokens
    through the model itself (vLLM's dummy run), on a KV cache of two blocks a layer (`attn`: a
    layer's Attention, for this rank's sizes). Every row op runs as serving runs it, whatever the
    family: the norms with their residual add and without, Qwen3's per-head norms on views of the
    qkv rows, silu·mul, each fp8 product's activations; and none of their integer arguments
    changes between steps, so one variant each is all serving meets."""
    dtype = model_dtype(model)
    shape = (2, block_size, attn.num_kv_heads, attn.head_size)
    kv_caches = [(torch.zeros(shape, dtype=dtype, device=device),
                  torch.zeros(shape, dtype=dtype, device=device))
                 for _ in range(sum(isinstance(m, Attention) for m in model.modules()))]
    ints = functools.partial(torch.tensor, dtype=torch.int32, device=device)
    step = AttentionMetadata(slot_mapping=torch.arange(2, device=device), block_tables=ints([[0, 1]]),
                             seq_lens=ints([2]), query_start_loc=ints([0, 2]), max_query_len=2)
    model(torch.zeros(2, dtype=torch.long, device=device), torch.arange(2, device=device), kv_caches, step)
    moes = {(m.num_experts, m.top_k, m.quantization, m.w13_weight.shape): m
            for m in model.modules() if isinstance(m, FusedMoE)}
    for moe in moes.values():
        rows = moe.num_experts + 1
        moe.impl(torch.zeros(rows, moe.w13_weight.shape[2], dtype=dtype, device=device),
                 torch.zeros(rows, moe.num_experts, dtype=dtype, device=device))
