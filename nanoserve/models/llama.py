"""llama.py: one implementation of the Llama family (Llama 2/3, Mistral, Qwen2, Qwen3, SmolLM).

These models differ only in a few switches, all read from the HF config:

    Llama / SmolLM   the base: RMSNorm, RoPE, GQA, SwiGLU MLP; Llama 3 adds rope_type "llama3"
    Mistral          the same modules (sliding window aside: see `sliding_window` below)
    Qwen2            q/k/v projections carry a bias (the architecture's, not a config switch)
    Qwen3            RMSNorm over each head of q and k before RoPE; head_dim from the config
    any              tie_word_embeddings: lm_head reuses the embedding matrix

The input is ONE flat batch of every token scheduled this step (no batch dim, no padding), with
`positions` for RoPE and an `AttentionMetadata` that says where each token's K/V goes and what it
attends to (see attention_metadata.py). The model is plain torch: it calls the ops of layers.py
(Linear, RMSNorm, SiluAndMul, RopeStoreKV, Attention), whose torch reference runs unless a
backend chose its own form at load, and it knows nothing of any backend. A layer reads
norm -> attention -> norm -> MLP:

    hidden, residual = input_layernorm(hidden, residual)            residual += hidden, normalised
    q, k, v = qkv_proj(hidden)                                      then RoPE; k, v into the cache
    hidden = o_proj(attn(q, kv_cache))
    hidden, residual = post_attention_layernorm(hidden, residual)
    hidden = down_proj(silu(gate) * up)                             gate, up = gate_up_proj(hidden)

For speed q/k/v is one Linear and gate/up is one Linear; `load_weights` takes HF checkpoint names
and fills the fused matrices:

    model.layers.0.self_attn.k_proj.weight  ->  rows [q_size, q_size + kv_size) of qkv_proj.weight
    model.layers.0.mlp.up_proj.weight       ->  rows [intermediate, 2 * intermediate) of gate_up_proj

Under tensor parallel (`tp`, distributed.py) each rank builds the modules of `shard_for_tp` and
reads only its part of each checkpoint tensor: q/k/v and gate/up are column-parallel (a rank's
heads, its slice of gate AND of up), o_proj and down_proj row-parallel (its input columns, then
an all-reduce), the embedding and LM head vocab-parallel.

Run the oracle tests (logits == HF transformers, prefill, chunked prefill and decode):
    pytest -q tests/test_models.py
"""

from __future__ import annotations

import copy
import math
from typing import Callable, Iterable, Optional

import torch
from torch import Tensor, nn

from nanoserve.attention_metadata import AttentionMetadata
from nanoserve.distributed import SINGLE, TensorParallel
from nanoserve.layers import Attention, Linear, RMSNorm, RopeStoreKV, SiluAndMul
from nanoserve.models.geometry import (get_head_size, get_num_attention_heads, get_num_kv_heads,
                                      get_total_num_kv_heads)
from nanoserve.quantization import quantize


def shard_for_tp(hf_config, tp: int):
    """The config one of `tp` ranks computes with, as vLLM shards a Llama: attention heads, KV
    heads (never below one: with tp > kv_heads each rank keeps a replica), the MLP's
    intermediate size and the vocabulary (rounded up: the last rank's slice is padded) split tp
    ways. Each rank builds its modules from it; the engine reads the same per-rank figures from
    geometry.py. (Whether the MLP splits is make_mlp's check: Mixtral has no dense MLP.)"""
    if tp == 1:
        return hf_config
    heads = hf_config.num_attention_heads
    kv_heads = get_total_num_kv_heads(hf_config)
    if heads % tp or (kv_heads % tp and tp % kv_heads):
        raise ValueError(f"tensor_parallel_size {tp} must divide num_attention_heads ({heads}), "
                         f"and divide, or be a multiple of, num_key_value_heads ({kv_heads})")
    shard = copy.deepcopy(hf_config)
    shard.head_dim = get_head_size(hf_config)  # explicit: hidden_size / heads no longer gives it
    shard.num_attention_heads = get_num_attention_heads(hf_config, tp)
    shard.num_key_value_heads = get_num_kv_heads(hf_config, tp)
    shard.intermediate_size = hf_config.intermediate_size // tp
    shard.vocab_size = -(-hf_config.vocab_size // tp)
    return shard


def rope_parameters(hf_config) -> dict:
    """The RoPE settings as one dict with `rope_theta` and `rope_type`, whichever transformers
    wrote the config: 5.x keeps them all in `rope_parameters`; 4.x has `rope_theta` plus an
    optional `rope_scaling` dict (whose type key was once spelled `type`)."""
    params = getattr(hf_config, "rope_parameters", None)
    if params is None:
        params = dict(getattr(hf_config, "rope_scaling", None) or {})
        params["rope_theta"] = getattr(hf_config, "rope_theta", 10000.0)
    params = dict(params)
    params["rope_type"] = params.get("rope_type", params.get("type", "default"))
    return params


def rope_inv_freq(head_dim: int, params: dict) -> Tensor:
    """Inverse frequency of each rotated pair, [head_dim // 2], float32."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (params["rope_theta"] ** exponents)
    rope_type = params["rope_type"]
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":  # positions divided by factor == frequencies divided by factor
        return inv_freq / params["factor"]
    if rope_type == "llama3":
        # Llama 3.1 stretches the context by slowing only the low frequencies: wavelengths longer
        # than original_len / low_freq_factor are divided by `factor`, shorter than
        # original_len / high_freq_factor are kept, and the band between is interpolated.
        factor, low, high = params["factor"], params["low_freq_factor"], params["high_freq_factor"]
        original_len = params["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        smooth = (original_len / wavelen - low) / (high - low)
        interpolated = (1 - smooth) * inv_freq / factor + smooth * inv_freq
        scaled = torch.where(wavelen > original_len / low, inv_freq / factor, inv_freq)
        is_medium = (wavelen <= original_len / low) & (wavelen >= original_len / high)
        return torch.where(is_medium, interpolated, scaled)
    raise ValueError(
        f"rope_type {rope_type!r} is not supported (supported: 'default', 'linear', 'llama3')"
    )


class RotaryEmbedding(nn.Module):
    """RoPE's table: cos/sin for every position up to max_position_embeddings, computed once, so a
    step only indexes them with its (arbitrary, per-token) positions, once for all layers."""

    def __init__(self, head_dim: int, max_position: int, params: dict):
        super().__init__()
        inv_freq = rope_inv_freq(head_dim, params)
        freqs = torch.arange(max_position, dtype=torch.float32)[:, None] * inv_freq[None, :]
        # Not persistent: derived from the config, never part of a checkpoint.
        self.register_buffer("cos", freqs.cos(), persistent=False)  # [max_position, head_dim // 2]
        self.register_buffer("sin", freqs.sin(), persistent=False)

    def forward(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """cos, sin for `positions` [num_tokens] -> each [num_tokens, 1, head_dim // 2]."""
        return self.cos[positions][:, None, :].to(dtype), self.sin[positions][:, None, :].to(dtype)


class LlamaAttention(nn.Module):
    def __init__(self, cfg, tp: TensorParallel, quantization: Optional[str] = None):
        super().__init__()
        self.tp = tp
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = get_num_kv_heads(cfg)     # cfg: this rank's shard
        self.head_dim = get_head_size(cfg)
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        # Qwen2 always has q/k/v biases and no o_proj bias; its config has no switch for it.
        # Llama and Qwen3 read `attention_bias`, which covers all four projections.
        if cfg.model_type == "qwen2":
            qkv_bias, o_bias = True, False
        else:
            qkv_bias = o_bias = getattr(cfg, "attention_bias", False)
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, qkv_bias, quantization)
        # Row-parallel: each rank multiplies its heads' columns; rank 0 alone adds the bias.
        self.o_proj = Linear(self.q_size, cfg.hidden_size, o_bias and tp.rank == 0, quantization)
        self.qk_norm = cfg.model_type in ("qwen3", "qwen3_moe")
        if self.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.rope_store_kv = RopeStoreKV()
        self.attn = Attention(self.num_heads, self.head_dim, self.head_dim**-0.5, self.num_kv_heads)

    def forward(self, rope, hidden: Tensor, kv_cache: tuple[Tensor, Tensor],
                attn_metadata: AttentionMetadata) -> Tensor:
        n = hidden.shape[0]
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(n, self.num_heads, self.head_dim)
        k = k.view(n, self.num_kv_heads, self.head_dim)
        v = v.view(n, self.num_kv_heads, self.head_dim)
        if self.qk_norm:   # Qwen3: RMSNorm over each head of q and k, before RoPE
            q, k = self.q_norm(q), self.k_norm(k)
        q = self.rope_store_kv(rope, q, k, v, kv_cache, attn_metadata.slot_mapping)
        out = self.o_proj(self.attn(q, kv_cache, attn_metadata).view(n, self.q_size))
        return self.tp.all_reduce(out) if self.tp.size > 1 else out


class LlamaMLP(nn.Module):
    def __init__(self, cfg, tp: TensorParallel, quantization: Optional[str] = None):
        super().__init__()
        self.tp = tp
        if cfg.hidden_act != "silu":
            raise ValueError(f"hidden_act {cfg.hidden_act!r} is not supported (the Llama family uses 'silu')")
        bias = getattr(cfg, "mlp_bias", False)
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias, quantization)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias and tp.rank == 0, quantization)
        self.act_fn = SiluAndMul()

    def forward(self, x: Tensor) -> Tensor:
        out = self.down_proj(self.act_fn(self.gate_up_proj(x)))
        return self.tp.all_reduce(out) if self.tp.size > 1 else out


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg, tp: TensorParallel, quantization: Optional[str], mlp: nn.Module):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = LlamaAttention(cfg, tp, quantization)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = mlp      # LlamaMLP, or a mixture of experts' block (mixture_of_experts.py)

    def forward(self, rope, hidden: Tensor, residual: Optional[Tensor], kv_cache,
                attn_metadata: AttentionMetadata) -> tuple[Tensor, Tensor]:
        """vLLM's layout of the residual stream: `hidden` is the previous layer's MLP output and
        `residual` the sum before it (None in layer 0, whose input is the embedding), so each
        norm also does the add before it. Returns (this layer's MLP output, the residual)."""
        if residual is None:
            hidden, residual = self.input_layernorm(hidden), hidden
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(rope, hidden, kv_cache, attn_metadata)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    def __init__(self, cfg, tp: TensorParallel, quantization: Optional[str],
                 make_mlp: Callable[[int], nn.Module]):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.rotary_emb = RotaryEmbedding(get_head_size(cfg), cfg.max_position_embeddings,
                                          rope_parameters(cfg))
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, tp, quantization, make_mlp(i))
                                    for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """`tp`: this rank's place in a tensor-parallel group; its modules get `shard_for_tp`'s
    shapes and `load_weights` reads only this rank's slice of each checkpoint tensor.
    `quantization` ('int8', 'fp8', quantization.py): the layers' Linears hold quantized weights,
    which `load_weights` fills by quantizing each slice as it reads it; the LM head only with
    `lm_head_quantization` (as llama.cpp's Q8_0; vLLM keeps it), tied or not (then a copy)."""

    def __init__(self, hf_config, tp: TensorParallel = SINGLE, quantization: Optional[str] = None,
                 lm_head_quantization: Optional[str] = None):
        super().__init__()
        self.config, self.tp = hf_config, tp
        self.shard_config = shard = shard_for_tp(hf_config, tp.size)
        self.vocab_range = tp.shard(hf_config.vocab_size)   # this rank's rows of the vocabulary
        self.model = LlamaModel(shard, tp, quantization, lambda i: self.make_mlp(i, quantization))
        self.lm_head = Linear(hf_config.hidden_size, shard.vocab_size, bias=False,
                              quantization=lm_head_quantization)
        self.tie_word_embeddings = getattr(hf_config, "tie_word_embeddings", False)
        if self.tie_word_embeddings and lm_head_quantization is None:
            self.lm_head.weight = self.model.embed_tokens.weight
        # HF masks attention beyond `sliding_window` tokens back (Mistral v0.1, Qwen with
        # use_sliding_window); paged attention does not, so outputs are exact only for sequences
        # up to this length. The model runner caps max_model_len with it; None means no window.
        layer_types = getattr(hf_config, "layer_types", None)
        sliding = layer_types is None or "sliding_attention" in layer_types
        self.sliding_window: int | None = getattr(hf_config, "sliding_window", None) if sliding else None

    def make_mlp(self, layer_index: int, quantization: Optional[str]) -> nn.Module:
        """Layer `layer_index`'s MLP: SwiGLU in every layer of this family (a mixture-of-experts
        family gives its sparse layers a router and experts: mixture_of_experts.py)."""
        if self.config.intermediate_size % self.tp.size:
            raise ValueError(f"tensor_parallel_size {self.tp.size} must divide intermediate_size "
                             f"({self.config.intermediate_size})")
        return LlamaMLP(self.shard_config, self.tp, quantization)

    def forward(
        self,
        input_ids: Tensor,
        positions: Tensor,
        kv_caches: list[tuple[Tensor, Tensor]],
        attn_metadata: AttentionMetadata,
    ) -> Tensor:
        """input_ids, positions [num_tokens] -> final hidden states [num_tokens, hidden_size]."""
        if len(kv_caches) != len(self.model.layers):
            raise ValueError(
                f"kv_caches has {len(kv_caches)} entries, the model {len(self.model.layers)} layers"
            )
        hidden, residual = self.embed(input_ids), None
        rope = self.model.rotary_emb(positions, hidden.dtype)
        for layer, kv_cache in zip(self.model.layers, kv_caches):
            hidden, residual = layer(rope, hidden, residual, kv_cache, attn_metadata)
        hidden, _ = self.model.norm(hidden, residual)
        return hidden

    def embed(self, input_ids: Tensor) -> Tensor:
        """Vocab-parallel under TP: a rank looks up the ids in its slice, zeros the others, and
        the all-reduce sums the one non-zero row of each token."""
        if self.tp.size == 1:
            return self.model.embed_tokens(input_ids)
        start, end = self.vocab_range
        outside = (input_ids < start) | (input_ids >= end)
        hidden = self.model.embed_tokens((input_ids - start).masked_fill_(outside, 0))
        return self.tp.all_reduce(hidden.masked_fill_(outside[:, None], 0))

    def compute_logits(self, hidden: Tensor) -> Optional[Tensor]:
        """hidden [n, hidden_size] (only the rows to sample) -> logits [n, vocab_size] in the model's
        dtype, as vLLM's: the sampler widens them to float32 where a stage computes with them (an
        all-greedy batch's argmax reads them as they are). Under TP each rank computes its vocab
        slice; rank 0 gets them all, other ranks None."""
        logits = self.lm_head(hidden)
        return self.tp.gather_logits(logits, self.config.vocab_size) if self.tp.size > 1 else logits

    def _checkpoint_targets(self) -> dict[str, Optional[tuple[Tensor, object, tuple, int]]]:
        """Every HF checkpoint name this model needs -> (our parameter, its rows for that weight,
        the index of this rank's part of the checkpoint tensor, the checkpoint's size along the
        dimension that index cuts). With one rank every part is the whole tensor. With tp ranks:
        column-parallel matrices (q, k, v, gate, up; their biases) and the vocabulary (embedding,
        LM head) give a rank a block of rows; the row-parallel o_proj and down_proj a block of
        columns; norms are replicated. A family may map a name to None: a tensor this rank does
        not hold and never reads (mixture_of_experts.py: another rank's expert)."""
        tp, every, cfg = self.tp, slice(None), self.config
        targets = {}
        for name, p in self.named_parameters():  # a tied lm_head is listed once, as embed_tokens
            targets[name] = (p, every, (every,), p.shape[0])
        if self.tie_word_embeddings:             # a quantized tied head: load_weights fills it
            targets.pop("lm_head.weight", None)
        start, end = self.vocab_range
        for name in ("model.embed_tokens.weight", "lm_head.weight"):
            if name in targets:
                targets[name] = (targets[name][0], slice(0, end - start), (slice(start, end),),
                                 cfg.vocab_size)
        attn = self.model.layers[0].self_attn
        q, kv, mlp = attn.q_size, attn.kv_size, self.shard_config.intermediate_size
        # KV heads: rank r reads from head r * kv_heads // tp; with fewer heads than ranks
        # that rounds down, so tp / kv_heads neighbouring ranks read (replicate) the same head.
        kv_heads = get_total_num_kv_heads(cfg)
        kv_first = tp.rank * kv_heads // tp.size * attn.head_dim
        fused = {  # our fused module -> the HF modules stacked in it, in row order: (name, our
            # rows, first row of this rank's part, rows of the checkpoint's matrix)
            "self_attn.qkv_proj": [("self_attn.q_proj", q, tp.rank * q, q * tp.size),
                                   ("self_attn.k_proj", kv, kv_first, kv_heads * attn.head_dim),
                                   ("self_attn.v_proj", kv, kv_first, kv_heads * attn.head_dim)],
            "mlp.gate_up_proj": [("mlp.gate_proj", mlp, tp.rank * mlp, cfg.intermediate_size),
                                 ("mlp.up_proj", mlp, tp.rank * mlp, cfg.intermediate_size)],
        }
        for i in range(len(self.model.layers)):
            for ours, parts in fused.items():
                for kind in ("weight", "bias"):
                    name = f"model.layers.{i}.{ours}.{kind}"
                    if name not in targets:  # a projection without bias, or a layer without it
                        continue
                    param = targets.pop(name)[0]
                    start = 0
                    for hf_module, num_rows, first, full in parts:
                        hf_name = f"model.layers.{i}.{hf_module}.{kind}"
                        targets[hf_name] = (param, slice(start, start + num_rows),
                                            (slice(first, first + num_rows),), full)
                        start += num_rows
            for module, cols in (("self_attn.o_proj", q), ("mlp.down_proj", mlp)):
                name = f"model.layers.{i}.{module}.weight"
                if name not in targets:      # a sparse layer of a mixture of experts: no down_proj
                    continue
                targets[name] = (targets[name][0], every,
                                 (every, slice(tp.rank * cols, (tp.rank + 1) * cols)),
                                 cols * tp.size)
        return targets

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, object]]) -> None:
        """Fill every parameter from (HF name, tensor) pairs, e.g. a safetensors file's items,
        or (HF name, safetensors slice) pairs (`safe_open(...).get_slice(name)`): then only this
        rank's part of each tensor is read from the file.

        Rotary `inv_freq` buffers (old checkpoints) are skipped, as is `lm_head.weight` when it is
        tied to the embedding, and on ranks other than 0 the row-parallel biases (rank 0 adds
        them once); so is, never read, a tensor another rank holds (its target is None: an expert
        held elsewhere). A name we do not know, a shape that does not match, or a weight the
        checkpoint lacks raises ValueError naming the weight.
        A quantized weight's part is quantized as it is read, its rows' scales into the buffer
        beside it named `<weight>_scale` (Linear's weight_scale, FusedMoE's w13_weight_scale and
        w2_weight_scale): only one full-precision tensor is ever in memory, never the model.
        """
        targets = self._checkpoint_targets()
        missing = {name for name, target in targets.items() if target is not None}
        scales = {id(p): (getattr(m, f"{n}_scale"), m.quantization) for m in self.modules()
                  for n, p in m.named_parameters(recurse=False) if hasattr(m, f"{n}_scale")}
        for name, tensor in weights:
            if name.endswith("rotary_emb.inv_freq"):
                continue
            if self.tie_word_embeddings and name == "lm_head.weight":
                continue
            if self.tp.rank > 0 and name.endswith(("o_proj.bias", "down_proj.bias")):
                continue
            if name not in targets:
                raise ValueError(f"unexpected weight {name!r} in the checkpoint for {type(self).__name__}")
            if targets[name] is None:
                continue
            param, rows, part, full = targets[name]
            dest = param.data[rows]
            # The checkpoint's shape: ours, with the dimension this rank's part cuts at full size.
            expected = list(dest.shape)
            expected[len(part) - 1] = full
            shape = list(tensor.shape if isinstance(tensor, Tensor) else tensor.get_shape())
            if shape != expected:
                raise ValueError(f"weight {name!r} has shape {tuple(shape)}, expected {tuple(expected)}")
            if id(param) in scales:
                scale_buffer, method = scales[id(param)]
                q, scale = quantize(tensor[part], method)
                dest.copy_(q)
                scale_buffer[rows].copy_(scale)
            else:
                dest.copy_(tensor[part])
            missing.discard(name)
        if missing:
            raise ValueError(f"checkpoint is missing weights: {sorted(missing)}")
        if self.tie_word_embeddings and self.lm_head.quantization:   # the embedding's rows, quantized
            q, scale = quantize(self.model.embed_tokens.weight, self.lm_head.quantization)
            self.lm_head.weight.copy_(q)
            self.lm_head.weight_scale.copy_(scale)
