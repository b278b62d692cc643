"""decode_plan.py: a decode step of the Llama model as one flat loop of C kernel calls (CPU).

Why: in a 64-request bf16 decode step the C kernels take ~48 ms, and the Python around them (module
calls, checks, pointer reads and shapes, for every product of every layer) took ~4 ms more. That
Python runs right after kernels that have streamed weights and KV cache through every cache level,
so it runs ~4x slower than the same code hot. The plan does those checks and reads once at start-up
(`DecodePlan.build`: the model's structure, each product's pointers and shapes) and once per step
(`__call__`: the step's buffers and attention arguments). What is left per layer is six C calls
(where a product's path is not a C call, F.linear or oneDNN, its Linear runs in its place):

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
CUDA graphs. The bench workload (SmolLM2-135M, 64 requests; 2-core Xeon with AMX, family 6 model
167), against the model's forward in three alternating runs: bf16 (every product on the AMX path)
1.03x, 1.10x, 1.04x; float32 (down_proj on F.linear, the rest on gemm.c) 1.07x, 0.99x, 1.06x.

A step runs here only where every request is a decode; `__call__` returns None for the others
(prefills), and the model's forward runs as usual. No plan (`build` returns None) without the C
kernels, under tensor parallel, for Qwen3's q/k norms, or in a dtype other than float32 and bf16.

    pytest -q tests/test_decode_plan.py
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
from torch import Tensor

from nanoserve.cpu import kernels as cpu_kernels
from nanoserve.models.linear import AmxGemm, KernelGemm, Linear


class Product(NamedTuple):
    """One Linear as gemm.c takes it: fn(x, residual, norm weight, eps, weight, bias, y, rows,
    *shape, threads), with `weight` the tensor the path multiplies (amx: the weight as it is;
    kernel: its packed panels) and `shape` the rest of the path's arguments. fn None: the path is
    not a C call (F.linear, oneDNN), and the plan calls the Linear itself."""
    fn: object
    weight: int
    bias: int
    shape: tuple
    max_rows: int        # the most rows the C path multiplies itself (amx: its loop's)
    linear: Linear
    gemm: object         # the Linear's gemm at build: keeps the tensors behind the pointers alive


def product_of(linear: Linear, kernels) -> Product:
    gemm, silu = linear.gemm, int(linear.silu_and_mul)
    if isinstance(gemm, AmxGemm):
        rows, cols = gemm.weight.shape
        return Product(kernels.gemm_amx, gemm.weight.data_ptr(), gemm.bias_f32.data_ptr(),
                       (rows, cols, silu), gemm.loop_rows, linear, gemm)
    if isinstance(gemm, KernelGemm):
        bf16 = int(gemm.packed.dtype == torch.bfloat16)
        return Product(kernels.gemm, gemm.packed.data_ptr(), gemm.bias.data_ptr(),
                       (gemm.out_features, linear.in_features, bf16, silu), 1 << 30, linear, gemm)
    return Product(None, 0, 0, (), 0, linear, gemm)


class Norm(NamedTuple):
    module: torch.nn.Module   # the RMSNorm, for a product that is not a C call
    weight: int               # its weight's pointer and its eps, for gemm.c
    eps: float


class Layer(NamedTuple):
    qkv: Product
    o: Product
    gate_up: Product
    down: Product
    input_norm: Norm
    post_attention_norm: Norm


class DecodePlan:
    def __init__(self, model, layers: list[Layer], kernels):
        self.model, self.layers = model, layers
        self.rope, self.attend = kernels.rope_store_kv, kernels.decode_attention
        attn = model.model.layers[0].self_attn
        self.num_heads, self.num_kv_heads, self.head_dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
        self.scale, self.dtype = attn.scale, model.model.embed_tokens.weight.dtype
        self.q_width, self.mlp_width = attn.q_size, model.shard_config.intermediate_size
        self.qkv_width = attn.q_size + 2 * attn.kv_size

    @staticmethod
    def build(model) -> Optional["DecodePlan"]:
        """The plan for `model` (a LlamaForCausalLM whose products have their paths: after
        choose_cpu_gemms; build again if they change), or None where it cannot run."""
        kernels, dtype = cpu_kernels.load(), model.model.embed_tokens.weight.dtype
        if (kernels is None or model.tp.size > 1 or model.model.layers[0].self_attn.qk_norm
                or dtype not in (torch.float32, torch.bfloat16)):   # the dtypes the kernels take
            return None
        layers = []
        for layer in model.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            products = [product_of(m, kernels)
                        for m in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)]
            norms = [Norm(norm, norm.weight.data_ptr(), norm.eps)
                     for norm in (layer.input_layernorm, layer.post_attention_layernorm)]
            layers.append(Layer(*products, *norms))
        return DecodePlan(model, layers, kernels)

    @torch.inference_mode()
    def __call__(self, input_ids: Tensor, positions: Tensor, kv_caches: list[tuple[Tensor, Tensor]],
                 attn_metadata) -> Optional[Tensor]:
        """The model's forward for this step (final hidden states), or None where the step has a
        prefill (the caller then runs the model)."""
        n = input_ids.shape[0]
        decodes, others = attn_metadata.cpu_split
        if others.indices or kv_caches[0][0].dtype != self.dtype:
            return None
        model = self.model
        hidden = model.embed(input_ids)
        cos, sin = model.model.rotary(positions, hidden.dtype)
        residual = torch.zeros_like(hidden)
        qkv, q, attn, mlp = (hidden.new_empty(n, width) for width in
                             (self.qkv_width, self.q_width, self.q_width, self.mlp_width))
        o = torch.empty_like(hidden)
        cos_p, sin_p, slots = cos.data_ptr(), sin.data_ptr(), attn_metadata.slot_mapping.data_ptr()
        query_start, _, block_tables, seq_lens, count, max_blocks = decodes.arguments
        threads, bf16 = torch.get_num_threads(), int(hidden.dtype == torch.bfloat16)
        rope, attend = self.rope, self.attend
        heads, kv_heads, head_dim = self.num_heads, self.num_kv_heads, self.head_dim
        block_size = kv_caches[0][0].shape[1]

        def multiply(p: Product, x: Tensor, y: Tensor, norm: Optional[Norm] = None) -> int:
            """y = p's product of x, or of norm(x + residual) (the residual updated in place
            first); gemm.c's status (0: done)."""
            if p.fn is None or n > p.max_rows:   # not a C call here: the Linear, as the model calls it
                y.copy_(p.linear(x) if norm is None else p.linear(x, norm.module, residual))
                return 0
            norm_args = (None, None, 0.0) if norm is None else (residual.data_ptr(), norm.weight, norm.eps)
            return p.fn(x.data_ptr(), *norm_args, p.weight, p.bias, y.data_ptr(), n, *p.shape, threads)

        failed = 0
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches, strict=True):
            k, v = k_cache.data_ptr(), v_cache.data_ptr()
            failed |= multiply(layer.qkv, hidden, qkv, layer.input_norm)
            rope(qkv.data_ptr(), cos_p, sin_p, slots, q.data_ptr(), k, v, n, heads, kv_heads, head_dim,
                 bf16, threads)
            failed |= attend(q.data_ptr(), attn.data_ptr(), k, v, query_start, block_tables, seq_lens,
                             count, max_blocks, block_size, kv_heads, heads // kv_heads, head_dim,
                             self.scale, bf16, threads)
            failed |= multiply(layer.o, attn, o)
            failed |= multiply(layer.gate_up, o, mlp, layer.post_attention_norm)
            failed |= multiply(layer.down, mlp, hidden)
        if failed:   # a kernel could not allocate its buffers (the layers after it ran on garbage)
            raise MemoryError("a CPU kernel could not allocate its buffers during a decode step")
        return model.model.norm(hidden, residual)[0]
