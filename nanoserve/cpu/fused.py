"""fused.py: the CPU backend's fused step: the Llama model's forward as one flat loop of C kernel
calls, built from the plain model's weights, as vLLM builds a CUDA graph from its eager model.

The model (models/llama.py) calls its ops one module at a time: norm, product, RoPE + store,
attention, product, norm, product, silu, product. Here the same kernels run in the same order on
the same numbers, with three fusions across ops that only the backend may make:

    qkv    = qkv_proj(rms_norm(hidden + residual))      residual += hidden, in place, first
    q      = rope_store_kv(qkv)                          RoPE; k, v written into this layer's cache
    attn   = attention(q, k_cache, v_cache)              decode_attention.c for an all-decode step
    o      = o_proj(attn)
    mlp    = silu_and_mul(gate_up_proj(rms_norm(o + residual)))
    hidden = down_proj(mlp)

  - the norm inside the product after it: gemm.c normalises each row as it copies it, so the
    normalised rows are never stored (the `kernel` and `amx` paths; the others norm first);
  - silu(gate) * up on gate_up's tiles, so gate_up is never stored (the same paths);
  - no Python between the kernels: the checks, pointer reads and shapes are done once at build
    and once per step, which leaves a few C calls a layer.

The output is the unfused backend's (the model on ops.py's forms) to the bit, and the torch
reference's within dtype rounding (tests/test_cpu_fused.py). Layer 0 has no residual yet; here it
starts as zeros, and hidden + 0 is hidden exactly. FusedStep.supports says where it runs: one
rank, no Qwen3 q/k norms, float32 or bf16; elsewhere the model runs on the unfused forms.

What it earns, against the unfused backend (NANOSERVE_CPU_FUSION=0: the same C kernels and product
paths, called op by op), on the bench workload (64 requests, SmolLM2-135M's shapes), the two taking
turns (scripts/compare_trees.py), AMD EPYC Zen 4 with AVX512-BF16, 2 cores: bf16 1.06x (medians
of 4 and of 3 rounds: 332.4 / 314.1 and 322.7 / 304.6 output tok/s), float32 1.06x (184.5 /
174.7, 2 rounds). scripts/results/README.md has the runs.

    pytest -q tests/test_cpu_fused.py
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
from torch import Tensor

from nanoserve.cpu import kernels as cpu_kernels
from nanoserve.cpu.gemm import NO_ROW_LIMIT, AmxGemm, Gemm, Int8KernelGemm, KernelGemm
from nanoserve.cpu.ops import CpuAttentionMetadata, paged_attention_cpu
from nanoserve.layers import RMSNorm

class Product(NamedTuple):
    """One Linear as gemm.c takes it: fn(x, residual, norm weight, eps, weight, bias, y, rows,
    *shape, threads), with `weight` the tensor the path multiplies (amx: the weight as it is;
    kernel: its packed panels; int8: its int8 panels, the scales last in `shape`) and `shape` the
    rest of the path's arguments. fn None: the path is
    not a C call (F.linear, oneDNN), and the step calls the Gemm itself."""
    fn: object
    weight: int
    bias: int
    shape: tuple
    max_rows: int        # the most rows the C path multiplies itself (amx: its loop's)
    gemm: Gemm           # also keeps the tensors behind the pointers alive


def product_of(gemm: Gemm, kernels) -> Product:
    silu = int(gemm.silu_and_mul)
    if isinstance(gemm, AmxGemm):
        rows, cols = gemm.weight.shape
        return Product(kernels.gemm_amx, gemm.weight.data_ptr(), gemm.bias_f32.data_ptr(),
                       (rows, cols, silu), gemm.loop_rows, gemm)
    if isinstance(gemm, Int8KernelGemm):
        return Product(kernels.gemm_int8, gemm.packed.data_ptr(), gemm.bias.data_ptr(),
                       (gemm.out_features, gemm.in_features, int(gemm.dtype == torch.bfloat16), silu,
                        gemm.scales.data_ptr(), gemm.register_rows), NO_ROW_LIMIT, gemm)
    if isinstance(gemm, KernelGemm):
        bf16 = int(gemm.packed.dtype == torch.bfloat16)
        return Product(kernels.gemm, gemm.packed.data_ptr(), gemm.bias.data_ptr(),
                       (gemm.out_features, gemm.in_features, bf16, silu), NO_ROW_LIMIT, gemm)
    return Product(None, 0, 0, (), 0, gemm)


class Norm(NamedTuple):
    module: RMSNorm   # the op, for a product that is not a C call
    weight: int       # its weight's pointer and its eps, for gemm.c
    eps: float


class Layer(NamedTuple):
    qkv: Product
    o: Product
    gate_up: Product
    down: Product
    input_norm: Norm
    post_attention_norm: Norm
    scale: float


class Step(NamedTuple):
    """What every layer of one step shares: its sizes, buffers and pointers, read once."""
    n: int
    residual: Tensor
    qkv: Tensor
    q: Tensor
    attn: Tensor
    o: Tensor
    mlp: Tensor
    rope: tuple[int, int, int]          # cos, sin, slot_mapping pointers
    decodes: Optional[tuple]            # decode_attention.c's arguments; None with a prefill
    attn_metadata: CpuAttentionMetadata
    threads: int


class FusedStep:
    """`FusedStep.build(model, gemms)(input_ids, positions, kv_caches, attn_metadata)` is
    `model(...)` for every step (the module docstring)."""

    def __init__(self, model, layers: list[Layer], kernels):
        self.model, self.layers = model, layers
        self.rope, self.attend = kernels.rope_store_kv, kernels.decode_attention
        attn = model.model.layers[0].self_attn
        self.num_heads, self.num_kv_heads, self.head_dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
        self.bf16 = int(model.model.embed_tokens.weight.dtype == torch.bfloat16)
        self.widths = (attn.q_size + 2 * attn.kv_size, attn.q_size, attn.q_size,
                       model.shard_config.intermediate_size)

    @staticmethod
    def supports(model) -> bool:
        """One rank, no q/k norms (rope.c reads the qkv rows as the product left them), and a
        dtype the kernels take."""
        return (model.tp.size == 1 and not model.model.layers[0].self_attn.qk_norm
                and model.model.embed_tokens.weight.dtype in (torch.float32, torch.bfloat16))

    @staticmethod
    def build(model, gemms: dict) -> "FusedStep":
        """The step for `model`, whose Linears multiply with `gemms` ({Linear: Gemm},
        cpu/gemm.py's choose_cpu_gemms, gate_up's built with silu_and_mul)."""
        kernels, layers = cpu_kernels.load(), []
        for layer in model.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            products = [product_of(gemms[m], kernels)
                        for m in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)]
            norms = [Norm(norm, norm.weight.data_ptr(), norm.eps)
                     for norm in (layer.input_layernorm, layer.post_attention_layernorm)]
            layers.append(Layer(*products, *norms, attn.attn.scale))
        return FusedStep(model, layers, kernels)

    @torch.inference_mode()
    def __call__(self, input_ids: Tensor, positions: Tensor, kv_caches: list[tuple[Tensor, Tensor]],
                 attn_metadata) -> Tensor:
        """The model's forward for this step: the final hidden states."""
        model, md = self.model, CpuAttentionMetadata.of(attn_metadata)
        n, hidden = input_ids.shape[0], model.embed(input_ids)
        cos, sin = model.model.rotary_emb(positions, hidden.dtype)
        qkv, q, attn, mlp = (hidden.new_empty(n, width) for width in self.widths)
        step = Step(n, torch.zeros_like(hidden), qkv, q, attn, torch.empty_like(hidden), mlp,
                    (cos.data_ptr(), sin.data_ptr(), md.slot_mapping.data_ptr()),
                    None if md.others.indices else md.decodes.arguments, md, torch.get_num_threads())
        failed = 0
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            failed |= self._layer(layer, step, hidden, kv_cache)
        if failed:   # a kernel could not allocate its buffers (the layers after it ran on garbage)
            raise MemoryError("a CPU kernel could not allocate its buffers during a step")
        return model.model.norm(hidden, step.residual)[0]

    def _layer(self, layer: Layer, step: Step, hidden: Tensor, kv_cache) -> int:
        """One decoder layer, `hidden` updated in place; the C calls' status (0: all done)."""
        (k_cache, v_cache), heads, kv_heads, head_dim = kv_cache, self.num_heads, self.num_kv_heads, self.head_dim
        failed = self._multiply(layer.qkv, step, hidden, step.qkv, layer.input_norm)
        self.rope(step.qkv.data_ptr(), *step.rope, step.q.data_ptr(), k_cache.data_ptr(),
                  v_cache.data_ptr(), step.n, heads, kv_heads, head_dim, self.bf16, step.threads)
        if step.decodes is None:   # a prefill among the requests: both attention kernels
            paged_attention_cpu(step.q.view(step.n, heads, head_dim), k_cache, v_cache,
                                step.attn_metadata, layer.scale, step.attn.view(step.n, heads, head_dim))
        else:
            query_start, _, block_tables, seq_lens, count, max_blocks = step.decodes
            failed |= self.attend(step.q.data_ptr(), step.attn.data_ptr(), k_cache.data_ptr(),
                                  v_cache.data_ptr(), query_start, block_tables, seq_lens, count,
                                  max_blocks, k_cache.shape[1], kv_heads, heads // kv_heads, head_dim,
                                  layer.scale, self.bf16, step.threads)
        failed |= self._multiply(layer.o, step, step.attn, step.o)
        failed |= self._multiply(layer.gate_up, step, step.o, step.mlp, layer.post_attention_norm)
        return failed | self._multiply(layer.down, step, step.mlp, hidden)

    @staticmethod
    def _multiply(p: Product, step: Step, x: Tensor, y: Tensor, norm: Optional[Norm] = None) -> int:
        """y = p's product of x, or of norm(x + residual) (the residual updated in place first);
        gemm.c's status (0: done)."""
        if p.fn is None or step.n > p.max_rows:   # not a C call here: the Gemm's own form
            y.copy_(p.gemm(x) if norm is None else p.gemm(x, norm.module, step.residual))
            return 0
        norm_args = (None, None, 0.0) if norm is None else (step.residual.data_ptr(), norm.weight, norm.eps)
        return p.fn(x.data_ptr(), *norm_args, p.weight, p.bias, y.data_ptr(), step.n, *p.shape,
                    step.threads)
