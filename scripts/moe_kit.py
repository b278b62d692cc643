"""moe_kit.py: a FusedMoE with random weights, for the scripts and tests that time or check its
forms (scripts/bench_fused_moe.py, scripts/gpu_moe.py, tests/test_fused_moe.py): one layer built
the same way everywhere.
"""

import torch

from nanoserve.layers import FusedMoE
from nanoserve.quantization import quantize


def random_moe(num_experts: int, top_k: int, hidden_size: int, intermediate_size: int,
               dtype: torch.dtype, quantization=None, expert_ids=None, renormalize: bool = True,
               seed: int = 0, device="cpu") -> FusedMoE:
    """The layer with weights ~ N(0, 1 / fan_in) (outputs of order 1) in `dtype`, or with
    `quantization` quantized per output channel; `expert_ids`: the experts this rank holds."""
    op = FusedMoE(num_experts, top_k, hidden_size, intermediate_size, renormalize,
                  expert_ids=expert_ids, quantization=quantization).to(device)
    g, local = torch.Generator(device=device).manual_seed(seed), len(op.expert_ids)
    for name, (rows, cols) in (("w13", (2 * intermediate_size, hidden_size)),
                               ("w2", (hidden_size, intermediate_size))):
        weight = torch.randn(local * rows, cols, generator=g, device=device) * cols**-0.5
        if quantization is None:
            getattr(op, f"{name}_weight").data = weight.to(dtype).view(local, rows, cols)
        else:
            q, scale = quantize(weight, quantization)
            getattr(op, f"{name}_weight").data = q.view(local, rows, cols)
            setattr(op, f"{name}_weight_scale", scale.view(local, rows))
    return op
