"""quantized.py: the CUDA backend's fp8 product (`--quantization fp8`): torch._scaled_mm where the
GPU multiplies fp8 (compute capability 8.9+: Ada, Hopper, Blackwell), as vLLM's fp8 does.

The weight is e4m3 with one scale per output channel (quantization.py). _scaled_mm multiplies two
fp8 operands, so each step's rows are quantized too, one scale per row (token), from their own
max: vLLM's dynamic per-token activation scales, in one Triton launch on the GPU
(activation_triton.per_token_quant_fp8_triton; per_token_quant_fp8_torch is its reference, and
what the CPU test multiplies with). Their product, times both scales, comes out in
bf16, the only output torch's row-wise scaling gives. Elsewhere (an older GPU, a float16 model,
a shape cuBLAS refuses) the Linear keeps its torch reference, which widens the fp8 weight to the
model dtype inside the product (backends.py logs one line saying so).

    pytest -q tests/test_quantization.py -k scaled_mm    # the selection, and the product on CPU
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from nanoserve.layers import Linear
from nanoserve.quantization import LARGEST, quantized_dtype


def uses_scaled_mm(linear: Linear, capability: tuple[int, int], dtype: torch.dtype) -> bool:
    """Whether `linear` multiplies with torch._scaled_mm on a GPU of this compute capability for a
    model in `dtype`: an fp8 weight, fp8 tensor cores (8.9+), bf16 (row-wise scaling's only
    output) and both sizes multiples of 16 (cuBLAS's fp8 layouts)."""
    return (linear.quantization == "fp8" and capability >= (8, 9) and dtype == torch.bfloat16
            and linear.in_features % 16 == 0 and linear.out_features % 16 == 0)


def per_token_quant_fp8_torch(rows: Tensor) -> tuple[Tensor, Tensor]:
    """rows [m, k] -> (e4m3 values [m, k], float32 scales [m, 1]): each row's scale from its own
    max (max |row| / 448), the torch reference of the one-launch kernel the backend binds
    (activation_triton.per_token_quant_fp8_triton)."""
    row_scale = rows.abs().amax(dim=1, keepdim=True).float().clamp(min=1e-12) / LARGEST["fp8"]
    return (rows.float() / row_scale).to(quantized_dtype("fp8")), row_scale


def scaled_mm_linear(linear: Linear, x: Tensor,
                     quantize_rows: Callable = per_token_quant_fp8_torch) -> Tensor:
    """Linear.forward for an fp8 weight with torch._scaled_mm: x's rows quantized to e4m3 with one
    scale each (`quantize_rows`: the torch reference, or the backend's Triton kernel), W.T
    column-major as stored ([out, in] row-major), y = (xq . q) x row scale x column scale + bias."""
    quantized, row_scale = quantize_rows(x.reshape(-1, linear.in_features))
    y = torch._scaled_mm(quantized, linear.weight.t(), scale_a=row_scale,
                         scale_b=linear.weight_scale[None, :], out_dtype=torch.bfloat16)
    y = y if linear.bias is None else y + linear.bias
    return y.view(*x.shape[:-1], linear.out_features)
