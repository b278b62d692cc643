"""layers.py: the seam. The few ops the model calls, each with its torch reference and the backend
forms that may replace it, chosen once at load (vLLM's CustomOp).

    Linear        y = x @ W.T + b                                  every product, the LM head too
    RMSNorm       x / rms(x) * w; with a residual: (norm(x + residual), x + residual)
    SiluAndMul    silu(gate) * up from the MLP's fused gate_up rows
    RopeStoreKV   RoPE on q and k, then k and v written into the paged cache; returns q
    Attention     each new token over its request's cached tokens (paged_attention.py)
    FusedMoE      a mixture of experts: each token's top-k experts' MLPs, weighted by the router

`forward_native` is the torch reference: the code the lessons cite, and what every other form is
tested against. `impl` is what `forward` calls: `forward_native` until a backend gives the op its
own form of the same math (backends.py picks the backend for the device: cuda/ has the Triton
kernels, cpu/ the C kernels and the products timed on this CPU). The model stays plain torch either
way, and its modules are called as modules, so `register_forward_hook` works on every op:

    >>> norm = RMSNorm(4, eps=1e-6)
    >>> seen = []
    >>> _ = norm.register_forward_hook(lambda module, args, out: seen.append(out.shape))
    >>> _ = norm(torch.ones(2, 4))
    >>> seen
    [torch.Size([2, 4])]

Whatever spans ops (a whole decode step as one loop of C calls, a fusion of two ops) is no op's
business: a backend builds them from the plain model's weights, as vLLM builds CUDA
graphs from its eager model, and gives the model runner the fused step as `Backend.forward`.

    pytest -q tests/test_models.py        # the model on these ops == HF transformers
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from nanoserve.attention_metadata import AttentionMetadata
from nanoserve.paged_attention import paged_attention_torch, store_kv_torch
from nanoserve.quantization import dequantize, quantized_dtype


class CustomOp(nn.Module):
    """An op whose `forward` runs `impl`: the torch reference unless a backend set its own form."""

    def __init__(self):
        super().__init__()
        self.impl: Callable = self.forward_native

    def forward(self, *args):
        return self.impl(*args)

    def forward_native(self, *args):
        raise NotImplementedError


class Linear(CustomOp):
    """y = x @ W.T + b. `weight` is [out_features, in_features], as in HF checkpoints.
    A backend may multiply another way (cpu/gemm.py: a packed weight, the path timed fastest on
    this CPU); the weight it was loaded with is what it multiplies.
    quantization ('int8', 'fp8'): `weight` holds int8 / float8_e4m3fn values q and `weight_scale`
    one float32 scale per output channel, W = q * scale (quantization.py); x, b and y stay in
    the model dtype."""

    def __init__(self, in_features: int, out_features: int, bias: bool,
                 quantization: Optional[str] = None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.quantization = quantization
        if quantization is None:
            self.weight = nn.Parameter(torch.empty(out_features, in_features))
        else:   # filled by the loader, which quantizes each checkpoint slice as it reads it
            self.weight = nn.Parameter(torch.empty(out_features, in_features,
                                                   dtype=quantized_dtype(quantization)), requires_grad=False)
            self.register_buffer("weight_scale", torch.empty(out_features, dtype=torch.float32))
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None

    def forward_native(self, x: Tensor) -> Tensor:
        if self.quantization is None:
            return F.linear(x, self.weight, self.bias)
        return F.linear(x, dequantize(self.weight, self.weight_scale, x.dtype), self.bias)


class RMSNorm(CustomOp):
    """HF's LlamaRMSNorm. Given a `residual`, it first adds x to it in place (vLLM's
    fused_add_rms_norm: the residual stream is updated, then normalised) and returns
    (normalised, residual)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward_native(self, x: Tensor, residual: Tensor | None = None):
        if residual is not None:
            x = residual.add_(x)
        # Normalise in float32 (bf16 squares lose too much), scale in the model dtype, as HF does.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        out = self.weight * x32.to(x.dtype)
        return out if residual is None else (out, residual)


class SiluAndMul(CustomOp):
    """silu(gate) * up from a gate_up product [..., 2 * intermediate], gate first (HF's
    act_fn(gate_proj(x)) * up_proj(x), with the two projections fused into one)."""

    def forward_native(self, gate_up: Tensor) -> Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate x [num_tokens, heads, head_dim]; HF's layout pairs dim i with dim i + head_dim / 2."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class RopeStoreKV(CustomOp):
    """q, k [tokens, heads, head_dim] rotated by the step's `rope` (cos, sin, each
    [tokens, 1, head_dim // 2]: RotaryEmbedding gives them once a step); the rotated k and v
    written into the layer's paged cache at `slot_mapping`. Returns the rotated q."""

    def forward_native(self, rope: tuple[Tensor, Tensor], q: Tensor, k: Tensor, v: Tensor,
                       kv_cache: tuple[Tensor, Tensor], slot_mapping: Tensor) -> Tensor:
        cos, sin = rope
        store_kv_torch(apply_rope(k, cos, sin), v, *kv_cache, slot_mapping)
        return apply_rope(q, cos, sin)


class Attention(CustomOp):
    """Causal attention of this step's queries [tokens, num_heads, head_size] over the paged cache
    of num_kv_heads heads (their own K/V already stored by RopeStoreKV) -> the same shape. The
    sizes are this rank's (vLLM's Attention): a backend reads them to compile its kernels."""

    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int):
        super().__init__()
        self.num_heads, self.head_size, self.num_kv_heads = num_heads, head_size, num_kv_heads
        self.scale = scale

    def forward_native(self, q: Tensor, kv_cache: tuple[Tensor, Tensor],
                       attn_metadata: AttentionMetadata) -> Tensor:
        return paged_attention_torch(q, *kv_cache, attn_metadata, self.scale)


def select_experts(router_logits: Tensor, top_k: int, renormalize: bool) -> tuple[Tensor, Tensor]:
    """The router: each token's top_k experts and their weights, from a softmax (in float32, as
    HF) over all the experts' logits; `renormalize` (Mixtral, Qwen3-MoE's norm_topk_prob) rescales
    the k weights to sum to 1. Returns (weights [tokens, k] float32, expert ids [tokens, k]).

    >>> w, ids = select_experts(torch.tensor([[0.0, 2.0, 1.0, 2.0]]), top_k=2, renormalize=True)
    >>> ids.tolist(), w.tolist()
    ([[1, 3]], [[0.5, 0.5]])
    """
    weights, ids = torch.softmax(router_logits, dim=-1, dtype=torch.float32).topk(top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


class FusedMoE(CustomOp):
    """A mixture of experts' MLPs (vLLM's FusedMoE): each token goes through the `top_k` experts
    its router logits pick (select_experts), and the experts' outputs are summed with the router's
    weights. Expert e is a gated MLP like LlamaMLP: w13_weight[e] [2 * intermediate, hidden] (gate
    rows, then up rows), w2_weight[e] [hidden, intermediate].
    `expert_ids`: the global ids of the experts this rank holds, in the order of the weights'
    first dimension (all of them without expert parallel); a token routed to an expert held
    elsewhere contributes nothing here, and the ranks' partial sums are added across them.
    quantization: w13_weight_scale [E, 2 * intermediate] and w2_weight_scale [E, hidden] hold
    each expert's per-output-channel scales, as Linear's weight_scale."""

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int,
                 renormalize: bool, expert_ids: Optional[list[int]] = None,
                 quantization: Optional[str] = None):
        super().__init__()
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.expert_ids = list(range(num_experts)) if expert_ids is None else list(expert_ids)
        self.quantization = quantization
        # vLLM's hook for a router of one's own (lesson 9's exercise puts the learner's here):
        # (router_logits, top_k, renormalize) -> (weights, expert ids), as select_experts
        self.custom_routing_function: Optional[Callable] = None
        local, dtype = len(self.expert_ids), (None if quantization is None else quantized_dtype(quantization))
        for name, rows, cols in (("w13", 2 * intermediate_size, hidden_size),
                                 ("w2", hidden_size, intermediate_size)):
            self.register_parameter(f"{name}_weight", nn.Parameter(
                torch.empty(local, rows, cols, dtype=dtype), requires_grad=quantization is None))
            if quantization is not None:
                self.register_buffer(f"{name}_weight_scale", torch.empty(local, rows, dtype=torch.float32))

    def route(self, router_logits: Tensor) -> tuple[Tensor, Tensor]:
        """Each token's (weights, expert ids): select_experts, or custom_routing_function if set.
        Every form of the op routes here."""
        return (self.custom_routing_function or select_experts)(router_logits, self.top_k,
                                                                 self.renormalize)

    def expert_weights(self, local: int, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """Expert `local`'s (w13, w2) in the model dtype (dequantized if quantized)."""
        if self.quantization is None:
            return self.w13_weight[local], self.w2_weight[local]
        return (dequantize(self.w13_weight[local], self.w13_weight_scale[local], dtype),
                dequantize(self.w2_weight[local], self.w2_weight_scale[local], dtype))

    def forward_native(self, hidden: Tensor, router_logits: Tensor) -> Tensor:
        """hidden [tokens, hidden_size], router_logits [tokens, num_experts] -> [tokens, hidden_size].
        Tokens grouped by expert: one product pair per expert that got tokens."""
        weights, ids = self.route(router_logits)
        out = torch.zeros_like(hidden)
        for local, expert in enumerate(self.expert_ids):
            token, slot = (ids == expert).nonzero(as_tuple=True)
            if token.numel() == 0:
                continue
            w13, w2 = self.expert_weights(local, hidden.dtype)
            gate, up = F.linear(hidden[token], w13).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, w2)
            out.index_add_(0, token, y * weights[token, slot, None].to(hidden.dtype))
        return out


def greedy_argmax(logits: Tensor) -> Tensor:
    """Each row's argmax: greedy sampling's token (a backend may have a faster one)."""
    return logits.argmax(dim=-1)


def new_kv_cache(shape: tuple, dtype: torch.dtype, device: torch.device) -> Tensor:
    """A zeroed K or V cache tensor of one layer."""
    return torch.zeros(shape, dtype=dtype, device=device)


@dataclass
class Backend:
    """What a backend hands the model runner, once, at load.

    forward:        one step's forward, (input_ids, positions, kv_caches, attn_metadata) -> hidden:
                    the model itself, or the backend's fused step built from its weights
    build_metadata: the step's AttentionMetadata as the backend's kernels read it (vLLM's
                    attention metadata builders); the common one where they need nothing more
    argmax:         the sampler's greedy argmax over logits rows
    new_kv_cache:   allocates one layer's K or V cache
    gemm_paths:     how each product shape multiplies, for `nanoserve bench` ({'576x1536 float32':
                    'kernel'}); 'torch' is F.linear
    cudagraph_capture_sizes: the batch sizes at which `forward` replays a captured decode step
                    (cuda/graphs.py): the runner pads a decode-only step up to the next one
                    (step_inputs.py); empty: every step runs as it is
    capture:        records those steps, once, given the runner's persistent inputs and KV cache"""
    name: str
    forward: Callable[..., Tensor]
    build_metadata: Callable[[AttentionMetadata], AttentionMetadata] = lambda md: md
    argmax: Callable[[Tensor], Tensor] = greedy_argmax
    new_kv_cache: Callable[..., Tensor] = new_kv_cache
    gemm_paths: dict[str, str] = field(default_factory=dict)
    cudagraph_capture_sizes: list[int] = field(default_factory=list)
    capture: Callable[..., None] = lambda inputs, kv_caches: None


def model_dtype(model: nn.Module) -> torch.dtype:
    """The dtype `model` computes in, whatever its (maybe quantized) weights hold: its embedding's,
    found by type, as a backend finds every op (never through a family's attribute names)."""
    return next(m.weight.dtype for m in model.modules() if isinstance(m, nn.Embedding))


def gemm_label(linear: Linear, dtype: torch.dtype) -> str:
    """'in x out dtype', the key of Backend.gemm_paths."""
    return f"{linear.in_features}x{linear.out_features} {str(dtype).removeprefix('torch.')}"
