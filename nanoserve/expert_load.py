"""expert_load.py: how many tokens each expert of a mixture of experts received in a step, for the
trace's `expert_load` event (`--trace`; `nanoserve trace --summary` shows the imbalance).

Why not count inside FusedMoE: its forms differ (the torch reference, the CPU's opaque C call, the
Triton kernel), and a captured step (CUDA graph or cpu/graphs.py) replays no Python, so a counter in
Python would see only eager steps. Instead a forward pre-hook on each FusedMoE copies the router
logits it is given into a buffer of this class's: the copy is part of the forward, so a capture
records it like any op. After the step the runner routes the REAL rows again (padding rows are
never read) with the op's own router (`FusedMoE.route`) and counts:

    >>> import torch
    >>> from nanoserve.layers import FusedMoE
    >>> moe = FusedMoE(num_experts=4, top_k=2, hidden_size=8, intermediate_size=4, renormalize=True)
    >>> _ = [p.data.zero_() for p in moe.parameters()]
    >>> load = ExpertLoad(moe, max_num_tokens=16, device=torch.device("cpu"))
    >>> _ = moe(torch.zeros(3, 8), torch.tensor([[3.0, 2, 0, 0], [0, 3, 2, 0], [9, 9, 9, 9]]))
    >>> load.counts(num_tokens=2)      # row 2 is padding: not counted
    [[1, 2, 1, 0]]

Only built when tracing: a step then pays one copy per MoE layer and one device read.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
from torch import Tensor, nn

from nanoserve.layers import FusedMoE


class ExpertLoad:
    """Router logits kept at fixed addresses, one buffer per FusedMoE of `model`, in model order."""

    @classmethod
    def of(cls, model: nn.Module, max_num_tokens: int, device: torch.device) -> Optional["ExpertLoad"]:
        """For a mixture of experts; None for a model without a FusedMoE."""
        has_moe = any(isinstance(m, FusedMoE) for m in model.modules())
        return cls(model, max_num_tokens, device) if has_moe else None

    def __init__(self, model: nn.Module, max_num_tokens: int, device: torch.device):
        self.ops = [m for m in model.modules() if isinstance(m, FusedMoE)]
        # float32, whatever the model's dtype: the router's softmax widens to it anyway
        # (select_experts), so routing the copy picks what routing the logits picked
        self.logits = [torch.zeros(max_num_tokens, op.num_experts, device=device) for op in self.ops]
        for op, logits in zip(self.ops, self.logits):
            op.register_forward_pre_hook(functools.partial(_keep, logits))

    def counts(self, num_tokens: int) -> list[list[int]]:
        """[MoE layer][expert]: the tokens routed there among the step's first `num_tokens` rows
        (each token counts once for each of its top_k experts)."""
        routed = [torch.bincount(op.route(logits[:num_tokens])[1].flatten(), minlength=op.num_experts)
                  for op, logits in zip(self.ops, self.logits)]
        return torch.stack(routed).tolist() if routed else []


def _keep(buffer: Tensor, op: FusedMoE, args: tuple) -> None:
    """The pre-hook: this forward's router logits (args: hidden, router_logits) into `buffer`."""
    router_logits = args[1]
    buffer[:router_logits.shape[0]].copy_(router_logits)
