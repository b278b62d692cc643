"""backend.py: the CUDA backend: the Triton kernels (paged_attention_triton.py) for storing K/V and
for attention over the paged cache, and fp8 products on torch._scaled_mm where the GPU has them
(quantized.py); every other op keeps its torch form (cuBLAS products, torch's own CUDA kernels for
the norms, RoPE and silu). Decode-only steps replay CUDA graphs of the model (graphs.py, graph_capture.py).

    pytest -q tests/test_paged_attention_triton.py     # the kernels == the torch reference
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from nanoserve.config import Config
from nanoserve.cuda.graphs import CUDAGraph
from nanoserve.cuda.paged_attention_triton import (compile_kernels, paged_attention_triton,
                                                   store_kv_triton)
from nanoserve.cuda.quantized import scaled_mm_linear, uses_scaled_mm
from nanoserve.graph_capture import GraphWrapper
from nanoserve.layers import Attention, Backend, Linear, RopeStoreKV, apply_rope, gemm_label


def rope_store_kv(rope, q: Tensor, k: Tensor, v: Tensor, kv_cache, slot_mapping: Tensor) -> Tensor:
    """RopeStoreKV.forward: torch's RoPE, one Triton launch to store k and v."""
    cos, sin = rope
    store_kv_triton(apply_rope(k, cos, sin), v, *kv_cache, slot_mapping)
    return apply_rope(q, cos, sin)


def attention(op: Attention, q: Tensor, kv_cache, attn_metadata) -> Tensor:
    """Attention.forward: one Triton launch for the whole mixed batch."""
    return paged_attention_triton(q, *kv_cache, attn_metadata, op.scale)


def bind(model, config: Config, gemm_paths: dict[str, str]) -> Backend:
    """The Triton forms for `model`'s ops, every kernel variant compiled now (compile_kernels), so
    that no step of serving stalls on a compile nor a graph capture meets one; fp8 Linears on
    torch._scaled_mm where the GPU multiplies fp8 (quantized.py); the forward wrapped for CUDA
    graphs of decode steps (graphs.py), which the runner captures once its KV cache exists: at
    one rank only (graph_capture.py: why not under tensor parallel)."""
    attn, weight = model.model.layers[0].self_attn, model.model.embed_tokens.weight
    compile_kernels(attn.num_heads, attn.num_kv_heads, attn.head_dim, config.block_size,
                    weight.dtype, weight.device)
    capability = torch.cuda.get_device_capability(weight.device)
    for module in model.modules():
        if isinstance(module, Linear) and uses_scaled_mm(module, capability, weight.dtype):
            module.impl = functools.partial(scaled_mm_linear, module)
            gemm_paths[gemm_label(module, module.weight.dtype)] = "scaled_mm"
        elif isinstance(module, RopeStoreKV):
            module.impl = rope_store_kv
        elif isinstance(module, Attention):
            module.impl = functools.partial(attention, module)
    sizes = config.cudagraph_capture_sizes if config.tensor_parallel_size == 1 else []
    if not sizes:
        return Backend("cuda", model, gemm_paths=gemm_paths)
    graphs = GraphWrapper(model, sizes, CUDAGraph)
    return Backend("cuda", graphs, gemm_paths=gemm_paths, cudagraph_capture_sizes=sizes,
                   capture=graphs.capture)
