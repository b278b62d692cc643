"""moe.py: the CPU backend's form of FusedMoE (layers.py), the mixture of experts.

What FusedMoE.forward_native computes, grouped once instead of once per expert: the router
(FusedMoE.route: select_experts) gives each token its top_k experts; the (token, expert) pairs are sorted by the
expert that holds them here, so each expert's tokens are one contiguous block of gathered rows;
each expert with tokens runs its two products on the path gemm.py timed for that shape (its
weights packed once per expert where the path packs; int8 weights on gemm.c's int8 product)
with silu·mul (silu_and_mul.c) between. The outputs, scaled by the router's weights, are summed
into each token's row by one index_add_, in forward_native's order (expert by expert, tokens
ascending). A pair routed to an expert this rank does not hold contributes nothing.

Where both products took the `amx` path, all of that after the router is one gemm.c call
(moe_amx), in one parallel region: the sort, the gather, each thread one stream across all the
experts' weights, every row count on the AMX loop (a prefill's hundreds of rows an expert too,
which F.linear ran 5x slower), the weighted sum with index_add_'s roundings. 30 layers of the
bench model, bf16: 16 tokens 44.9 -> 29.3 ms, 2048 tokens 491 -> 292 ms (scripts/results/README.md).

Capture (graphs.py): which expert gets which rows depends on the values, so the whole op is one
opaque call of a captured step, on the step's fixed buffers; a replay groups afresh.

    pytest -q tests/test_fused_moe.py -k cpu
    python scripts/bench_fused_moe.py              # against forward_native, on this CPU
"""

from __future__ import annotations

import torch
from torch import Tensor

from nanoserve.config import Config
from nanoserve.cpu import kernels as cpu_kernels
from nanoserve.cpu.gemm import choose_path, make_gemm, timed_rows
from nanoserve.cpu.graphs import opaque
from nanoserve.cpu.ops import silu_and_mul
from nanoserve.layers import FusedMoE


def experts_label(weight: Tensor) -> str:
    """Backend.gemm_paths' key for one expert's product: 'in x out dtype experts'."""
    return f"{weight.shape[2]}x{weight.shape[1]} {str(weight.dtype).removeprefix('torch.')} experts"


class CpuFusedMoE:
    """One FusedMoE's CPU form: `forward` is its impl. Takes the op's weights: its Gemms hold what
    they multiply (as a Linear's does), so the op keeps none (forward_native cannot run after)."""

    def __init__(self, op: FusedMoE, dtype: torch.dtype, config: Config, labels: dict[str, str]):
        self.route, self.top_k, self.local = op.route, op.top_k, len(op.expert_ids)
        rows, weights, paths = timed_rows(config.max_num_batched_tokens), {}, {}
        for name in ("w13", "w2"):
            weight = getattr(op, f"{name}_weight").detach()
            weights[name] = (weight, getattr(op, f"{name}_weight_scale") if op.quantization else None)
            scale = weights[name][1]
            paths[name] = choose_path(labels, experts_label(weight), weight[0], None,
                                      None if scale is None else scale[0], dtype, rows, config)
        self.grouped, self.experts = None, []   # one of the two forms (products)
        if paths["w13"] == paths["w2"] == "amx":   # (w13, w2, zero bias) for gemm.c's moe_amx
            w13, w2 = (weights[name][0].contiguous() for name in ("w13", "w2"))
            self.grouped = (w13, w2, torch.zeros(max(w13.shape[1], w2.shape[1])))
        else:                                      # [w13, w2] Gemms per local expert
            self.experts = [[make_gemm(paths[name], w[e], None, None if s is None else s[e], dtype)
                             for name, (w, s) in weights.items()] for e in range(self.local)]
        op.w13_weight = op.w2_weight = None
        # global expert id -> local index; an expert held elsewhere -> `local`, sorted last, dropped
        self.local_of = torch.full((op.num_experts,), self.local)
        self.local_of[op.expert_ids] = torch.arange(self.local)
        self.compute = opaque(self.compute_into)

    def forward(self, hidden: Tensor, router_logits: Tensor) -> Tensor:
        """FusedMoE.forward: hidden [tokens, hidden_size], router_logits [tokens, num_experts]."""
        out = torch.empty_like(hidden)
        self.compute(hidden, router_logits, out)
        return out

    def compute_into(self, hidden: Tensor, router_logits: Tensor, out: Tensor) -> None:
        """out = FusedMoE.forward_native(hidden, router_logits) (the module docstring)."""
        weights, ids = self.route(router_logits)
        if self.grouped:
            return cpu_kernels.moe_amx(hidden, weights, ids, self.local_of, *self.grouped, out)
        local = self.local_of[ids.flatten()]
        order = local.argsort(stable=True)   # pairs by local expert, tokens ascending within one
        counts = torch.bincount(local, minlength=self.local + 1).tolist()[:-1]
        held = sum(counts)
        tokens = order[:held] // self.top_k
        rows, ys, start = hidden[tokens], [], 0
        for (w13, w2), n in zip(self.experts, counts):
            if n:
                ys.append(w2.product(silu_and_mul(w13.product(rows[start:start + n]))))
                start += n
        out.zero_()
        if ys:
            y = torch.cat(ys) if len(ys) > 1 else ys[0]
            out.index_add_(0, tokens, y * weights.flatten()[order[:held], None].to(hidden.dtype))
