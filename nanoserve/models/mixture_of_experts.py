"""mixture_of_experts.py: the mixture-of-experts families, Qwen3-MoE and Mixtral: Llama's layers
(llama.py), with a router and a set of experts in place of the MLP in each sparse layer.

    Mixtral     Llama's attention; every layer sparse: num_local_experts experts, each a SwiGLU
                MLP of intermediate_size, num_experts_per_tok of them a token, weights renormalized
    Qwen3-MoE   Qwen3's attention (q/k norms); num_experts experts of moe_intermediate_size,
                renormalized if norm_topk_prob; the layers in mlp_only_layers, and those off
                decoder_sparse_step, keep a dense MLP of intermediate_size

A sparse layer reads norm -> attention -> norm -> MoE block (vLLM's Qwen3MoeSparseMoeBlock and
MixtralMoE):

    router_logits = gate(hidden)               [tokens, num_experts]: a Linear, the router
    hidden = experts(hidden, router_logits)    FusedMoE (layers.py): each token's top-k experts'
                                               MLPs, summed with the router's weights

A checkpoint holds each expert's three matrices apart (the hub's layout); `load_weights` stacks
them into FusedMoE's w13 (gate rows, then up rows) and w2, as llama.py fuses q/k/v:

    model.layers.0.mlp.experts.3.gate_proj.weight   ->  w13_weight[3, :intermediate]
    model.layers.0.mlp.experts.3.up_proj.weight     ->  w13_weight[3, intermediate:]
    model.layers.0.mlp.experts.3.down_proj.weight   ->  w2_weight[3]
    (Mixtral: block_sparse_moe.experts.3.w1 gate, .w3 up, .w2 down; router block_sparse_moe.gate)

Under tensor parallel a rank holds, of every expert, its slice of the intermediate dimension (of
gate AND up, down's columns), as of a dense MLP; with `enable_expert_parallel` (distributed.py)
it holds num_experts / tp whole experts (FusedMoE's `expert_ids`) and never reads the others'
tensors. Either way the block's output is this rank's partial sum, all-reduced as the dense
MLP's is. Under data parallel + expert parallel (TP 1) the DP ranks share the experts out the
same way, and each block exchanges its tokens with the other ranks around the experts
(distributed.py's dispatch and combine: all-gather, then reduce-scatter). The router is
replicated and, as in vLLM, never quantized: `--quantization` quantizes each expert per output
channel (FusedMoE's w13_weight_scale, w2_weight_scale).

    pytest -q tests/test_moe.py

Lesson: lessons/09-mixture-of-experts.md (the router, total against active parameters, TP and EP).
"""

from __future__ import annotations

from typing import Optional

from torch import Tensor, nn

from nanoserve.distributed import TensorParallel
from nanoserve.layers import FusedMoE, Linear
from nanoserve.models.llama import LlamaForCausalLM


class SparseMoeBlock(nn.Module):
    """The router (`gate`) and the experts: hidden [tokens, hidden_size] -> the same shape.
    `num_experts_field`: the config's name for the number of experts, for errors."""

    def __init__(self, cfg, tp: TensorParallel, quantization: Optional[str], num_experts_field: str,
                 num_experts: int, intermediate_size: int, renormalize: bool):
        super().__init__()
        if cfg.hidden_act != "silu":
            raise ValueError(f"hidden_act {cfg.hidden_act!r} is not supported (the experts use 'silu')")
        self.tp, expert_ids = tp, None        # None: every expert, a slice of each
        if tp.enable_expert_parallel:
            dp = tp.expert_exchange          # DP+EP: shared out among the DP ranks (TP 1)
            rank, size = (dp.rank, dp.size) if dp else (tp.rank, tp.size)
            if num_experts % size:
                field = "data_parallel_size" if dp else "tensor_parallel_size"
                raise ValueError(f"enable_expert_parallel: {field} {size} must divide "
                                 f"{num_experts_field} ({num_experts})")
            per_rank = num_experts // size
            expert_ids = range(rank * per_rank, (rank + 1) * per_rank)
        elif intermediate_size % tp.size:
            raise ValueError(f"tensor_parallel_size {tp.size} must divide the experts' "
                             f"intermediate size ({intermediate_size}), or use enable_expert_parallel")
        else:
            intermediate_size //= tp.size
        # The router stays in the model dtype under --quantization (as vLLM): its top-k is sensitive.
        self.gate = Linear(cfg.hidden_size, num_experts, bias=False)
        self.experts = FusedMoE(num_experts, cfg.num_experts_per_tok, cfg.hidden_size,
                                intermediate_size, renormalize, expert_ids, quantization)

    def forward(self, hidden: Tensor) -> Tensor:
        router_logits = self.gate(hidden)
        if exchange := self.tp.expert_exchange:    # DP+EP: every rank's tokens, our experts
            return exchange.combine(self.experts(*exchange.dispatch(hidden, router_logits)))
        out = self.experts(hidden, router_logits)
        return self.tp.all_reduce(out) if self.tp.size > 1 else out


class MixtureOfExpertsForCausalLM(LlamaForCausalLM):
    """LlamaForCausalLM with a SparseMoeBlock as the MLP of each sparse layer. A family says which
    layers are sparse and with what experts (`moe_block`), and how its checkpoint names them."""

    moe_prefix: str                        # the block's name in a checkpoint layer
    expert_names: tuple[str, str, str]     # an expert's gate, up and down matrices there

    def moe_block(self, layer_index: int, quantization: Optional[str]) -> Optional[SparseMoeBlock]:
        """Layer `layer_index`'s MoE block, or None where it is dense."""
        raise NotImplementedError

    def make_mlp(self, layer_index: int, quantization: Optional[str]) -> nn.Module:
        block = self.moe_block(layer_index, quantization)
        return super().make_mlp(layer_index, quantization) if block is None else block

    def _checkpoint_targets(self) -> dict:
        """llama.py's, with each sparse layer's router and experts under the checkpoint's names."""
        targets = super()._checkpoint_targets()
        for i, layer in enumerate(self.model.layers):
            if isinstance(layer.mlp, SparseMoeBlock):
                ours, theirs = f"model.layers.{i}.mlp", f"model.layers.{i}.{self.moe_prefix}"
                targets[f"{theirs}.gate.weight"] = targets.pop(f"{ours}.gate.weight")
                w13, w2 = (targets.pop(f"{ours}.experts.{w}")[0] for w in ("w13_weight", "w2_weight"))
                targets.update(self._expert_targets(f"{theirs}.experts", layer.mlp.experts, w13, w2))
        return targets

    def _expert_targets(self, prefix: str, experts: FusedMoE, w13: Tensor, w2: Tensor) -> dict:
        """Each expert's gate, up and down matrices -> its rows of w13 and w2 (targets as in
        llama.py): this rank's slice of the intermediate dimension of each; under expert parallel
        its own experts whole, and None (never read) for the others'."""
        size, every = w2.shape[2], slice(None)     # this rank's intermediate rows of each expert
        if self.tp.enable_expert_parallel:
            part, full = every, size
        else:
            part, full = slice(self.tp.rank * size, (self.tp.rank + 1) * size), size * self.tp.size
        local_of = {expert: local for local, expert in enumerate(experts.expert_ids)}
        targets = {}
        for e in range(experts.num_experts):
            names = [f"{prefix}.{e}.{name}.weight" for name in self.expert_names]
            if e not in local_of:
                targets.update(dict.fromkeys(names))
                continue
            local = local_of[e]
            targets.update(zip(names, [(w13, (local, slice(0, size)), (part,), full),
                                       (w13, (local, slice(size, 2 * size)), (part,), full),
                                       (w2, local, (every, part), full)]))
        return targets


class Qwen3MoeForCausalLM(MixtureOfExpertsForCausalLM):
    moe_prefix, expert_names = "mlp", ("gate_proj", "up_proj", "down_proj")

    def moe_block(self, layer_index: int, quantization: Optional[str]) -> Optional[SparseMoeBlock]:
        cfg = self.config
        if (layer_index in cfg.mlp_only_layers or cfg.num_experts == 0
                or (layer_index + 1) % cfg.decoder_sparse_step):
            return None
        return SparseMoeBlock(cfg, self.tp, quantization, "num_experts", cfg.num_experts,
                              cfg.moe_intermediate_size, renormalize=cfg.norm_topk_prob)


class MixtralForCausalLM(MixtureOfExpertsForCausalLM):
    moe_prefix, expert_names = "block_sparse_moe", ("w1", "w3", "w2")    # w1 gate, w3 up, w2 down

    def moe_block(self, layer_index: int, quantization: Optional[str]) -> SparseMoeBlock:
        cfg = self.config
        return SparseMoeBlock(cfg, self.tp, quantization, "num_local_experts", cfg.num_local_experts,
                              cfg.intermediate_size, renormalize=True)
