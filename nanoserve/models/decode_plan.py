"""decode_plan.py: a decode step of the Llama model as one flat loop of C kernel calls (CPU).

Why: in a 64-request bf16 decode step the C kernels take ~48 ms, and the Python around them (module
calls, checks, pointer reads and shapes, for every product of every layer) took ~4 ms more. That
Python runs right after kernels that have streamed weights and KV cache through every cache level,
so it runs ~4x slower than the same code hot. The plan does those checks and reads once at start-up
(`DecodePlan.build`: the model's structure, each product's pointers and shapes) and once per step
(`__call__`: the step's buffers and attention arguments). What is left per layer is six C calls:

    qkv    = qkv_proj(rms_norm(hidden + residual))      residual += hidden, in place, first
    q      = rope_store_kv(qkv)                          RoPE; k, v written into this layer's cache
    attn   = decode_attention(q, k_cache, v_cache)
    o      = o_proj(attn)
    mlp    = gate_up_proj(rms_norm(o + residual))        then silu(gate) * up; residual += o first
    hidden = down_proj(mlp)

the kernels models/llama.py runs for the same step, in the same order, on the same numbers: the
output is the module path's to the bit (tests/test_decode_plan.py). Layer 0 has no residual yet;
here it starts as zeros, and hidden + 0 is hidden exactly. In vLLM the same job (the same kernels
with less launch overhead, the eager model as the reference and the fallback) is done on GPUs by
CUDA graphs. The bench workload (SmolLM2-135M, 64 requests, bf16, every product on the AMX path;
2-core Xeon with AMX, family 6 model 167): 1.03x, 1.10x, 1.04x in three alternating runs.

A step runs here only where the module path would run exactly these kernels: every request a
decode, every product of every layer on csrc/gemm.c (linear.py's `kernel` path, or `amx` within
its loop's row count), one rank, no q/k norms (Qwen3). Otherwise `__call__` returns None and the
model's forward runs as usual.

    pytest -q tests/test_decode_plan.py
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
from torch import Tensor

from nanoserve import cpu_kernels
from nanoserve.models.linear import AmxGemm, KernelGemm, Linear


class Product(NamedTuple):
    """One Linear as gemm.c takes it: fn(x, residual, norm weight, eps, weight, bias, y, rows,
    *shape, threads), with `weight` the tensor the path multiplies (amx: the weight as it is;
    kernel: its packed panels) and `shape` the rest of the path's arguments."""
    fn: object
    weight: int
    bias: int
    shape: tuple
    max_rows: int        # the most rows this path multiplies itself (amx: its loop's)
    owner: object        # the gemm object, which keeps the tensors behind the pointers alive


def product_of(linear: Linear, kernels) -> Optional[Product]:
    gemm, silu = linear.gemm, int(linear.silu_and_mul)
    if isinstance(gemm, AmxGemm):
        rows, cols = gemm.weight.shape
        return Product(kernels.gemm_amx, gemm.weight.data_ptr(), gemm.bias_f32.data_ptr(),
                       (rows, cols, silu), gemm.loop_rows, gemm)
    if isinstance(gemm, KernelGemm):
        bf16 = int(gemm.packed.dtype == torch.bfloat16)
        return Product(kernels.gemm, gemm.packed.data_ptr(), gemm.bias.data_ptr(),
                       (gemm.out_features, linear.in_features, bf16, silu), 1 << 30, gemm)
    return None   # F.linear or oneDNN: not a C call


class Layer(NamedTuple):
    qkv: Product
    o: Product
    gate_up: Product
    down: Product
    input_norm: tuple[int, float]      # (weight pointer, eps)
    post_attention_norm: tuple[int, float]


class DecodePlan:
    def __init__(self, model, layers: list[Layer]):
        self.model, self.layers = model, layers
        attn = model.model.layers[0].self_attn
        self.num_heads, self.num_kv_heads, self.head_dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
        self.scale, self.dtype = attn.scale, model.model.embed_tokens.weight.dtype
        self.q_width, self.mlp_width = attn.q_size, model.shard_config.intermediate_size
        self.qkv_width = attn.q_size + 2 * attn.kv_size
        self.max_rows = min(p.max_rows for layer in layers for p in layer[:4])

    @staticmethod
    def build(model) -> Optional["DecodePlan"]:
        """The plan for `model` (a LlamaForCausalLM whose products have their paths: after
        choose_cpu_gemms; build again if they change), or None where it cannot run."""
        kernels = cpu_kernels.load()
        first = model.model.layers[0].self_attn
        if kernels is None or model.tp.size > 1 or first.qk_norm:
            return None
        layers = []
        for layer in model.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
            products = [product_of(m, kernels) for m in linears]
            if None in products:
                return None
            norms = [(norm.weight.data_ptr(), norm.eps)
                     for norm in (layer.input_layernorm, layer.post_attention_layernorm)]
            layers.append(Layer(*products, *norms))
        return DecodePlan(model, layers)

    @torch.inference_mode()
    def __call__(self, input_ids: Tensor, positions: Tensor, kv_caches: list[tuple[Tensor, Tensor]],
                 attn_metadata) -> Optional[Tensor]:
        """The model's forward for this step (final hidden states), or None where the step has a
        prefill or more rows than a product's C path takes (the caller then runs the model)."""
        n = input_ids.shape[0]
        decodes, others = attn_metadata.cpu_split
        if others.indices or n > self.max_rows or kv_caches[0][0].dtype != self.dtype:
            return None
        model = self.model
        hidden = model.embed(input_ids)
        cos, sin = model.model.rotary(positions, hidden.dtype)
        residual = torch.zeros_like(hidden)
        qkv, q, attn, mlp = (hidden.new_empty(n, width) for width in
                             (self.qkv_width, self.q_width, self.q_width, self.mlp_width))
        o = torch.empty_like(hidden)
        x, r, qkv_p, q_p, attn_p, o_p, mlp_p = (
            t.data_ptr() for t in (hidden, residual, qkv, q, attn, o, mlp))
        cos_p, sin_p, slots = cos.data_ptr(), sin.data_ptr(), attn_metadata.slot_mapping.data_ptr()
        query_start, _, block_tables, seq_lens, count, max_blocks = decodes.arguments
        threads, bf16 = torch.get_num_threads(), int(hidden.dtype == torch.bfloat16)
        rope, attend = cpu_kernels.load().rope_store_kv, cpu_kernels.load().decode_attention
        heads, kv_heads, head_dim = self.num_heads, self.num_kv_heads, self.head_dim
        block_size = kv_caches[0][0].shape[1]
        failed = 0
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches, strict=True):
            k, v = k_cache.data_ptr(), v_cache.data_ptr()
            p = layer.qkv
            failed |= p.fn(x, r, *layer.input_norm, p.weight, p.bias, qkv_p, n, *p.shape, threads)
            rope(qkv_p, cos_p, sin_p, slots, q_p, k, v, n, heads, kv_heads, head_dim, bf16, threads)
            failed |= attend(q_p, attn_p, k, v, query_start, block_tables, seq_lens, count, max_blocks,
                             block_size, kv_heads, heads // kv_heads, head_dim, self.scale, bf16, threads)
            p = layer.o
            failed |= p.fn(attn_p, None, None, 0.0, p.weight, p.bias, o_p, n, *p.shape, threads)
            p = layer.gate_up
            failed |= p.fn(o_p, r, *layer.post_attention_norm, p.weight, p.bias, mlp_p, n, *p.shape, threads)
            p = layer.down
            failed |= p.fn(mlp_p, None, None, 0.0, p.weight, p.bias, x, n, *p.shape, threads)
        if failed:   # a kernel could not allocate its buffers (the layers after it ran on garbage)
            raise MemoryError("a CPU kernel could not allocate its buffers during a decode step")
        return model.model.norm(hidden, residual)[0]
