"""activation_triton.py: Triton kernels on the MLP's activations, one launch each.

  silu_and_mul_triton        SiluAndMul.forward: silu(gate) * up from the fused gate_up rows
                             (torch: chunk, silu, mul: two kernels and a temporary).
  per_token_quant_fp8_triton the fp8 product's activations (quantized.py): each row's max, its
                             float32 scale and its e4m3 values in one launch (torch: abs, amax,
                             clamp, divide, divide, cast: six launches a product).

Same numbers as the torch forms they replace: silu is rounded to the model dtype before the
product, as F.silu's output is; the fp8 scale is max|row| / 448 (clamped at 1e-12 / 448) and
each value (x / scale) rounded to e4m3, exactly per_token_quant_fp8_torch's arithmetic. Example,
a row [1, -2, 4]: scale 4 / 448, values [112, -224, 448].

    TRITON_INTERPRET=1 pytest -q tests/test_triton_ops.py     # on CPU, == the torch forms
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nanoserve.quantization import LARGEST, quantized_dtype


@triton.jit
def _silu_and_mul_kernel(out_ptr, x_ptr, stride_ot, stride_xt, D: tl.constexpr,
                         BLOCK: tl.constexpr):
    token, cols = tl.program_id(0).to(tl.int64), tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < D
    gate = tl.load(x_ptr + token * stride_xt + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + token * stride_xt + D + cols, mask=mask, other=0.0).to(tl.float32)
    g = gate.to(tl.float32)
    silu = (g / (1.0 + tl.exp(-g))).to(gate.dtype).to(tl.float32)  # F.silu's output: model dtype
    tl.store(out_ptr + token * stride_ot + cols, (silu * up).to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul_triton(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate_up[..., :d]) * gate_up[..., d:] -> [..., d]."""
    if gate_up.stride(-1) != 1 or gate_up.shape[-1] % 2:
        raise ValueError(f"gate_up: expected an even, contiguous last dimension, got shape "
                         f"{tuple(gate_up.shape)} strides {gate_up.stride()}")
    x = gate_up.reshape(-1, gate_up.shape[-1])   # a view in the model: the product's rows
    d = x.shape[1] // 2
    out = torch.empty(x.shape[0], d, dtype=x.dtype, device=x.device)
    if x.shape[0]:
        block = min(1024, triton.next_power_of_2(d))
        _silu_and_mul_kernel[(x.shape[0], triton.cdiv(d, block))](
            out, x, out.stride(0), x.stride(0), D=d, BLOCK=block, num_warps=4)
    return out.view(*gate_up.shape[:-1], d)


@triton.jit
def _per_token_quant_fp8_kernel(out_ptr, scale_ptr, x_ptr, stride_ot, stride_xt,
                                K: tl.constexpr, BLOCK: tl.constexpr, FP8_MAX: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    amax = tl.zeros([BLOCK], tl.float32)
    for start in range(0, K, BLOCK):  # pass 1: the row's max |x|
        x = tl.load(x_ptr + row * stride_xt + start + cols, mask=start + cols < K, other=0.0)
        amax = tl.maximum(amax, tl.abs(x.to(tl.float32)))
    # div_rn: IEEE division, as torch divides (Triton's `/` is div.full, within 2 ulp).
    scale = tl.math.div_rn(tl.maximum(tl.max(amax, axis=0), 1e-12), FP8_MAX)
    tl.store(scale_ptr + row, scale)
    for start in range(0, K, BLOCK):  # pass 2: the values (the row is in L2 by now)
        mask = start + cols < K
        x = tl.load(x_ptr + row * stride_xt + start + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * stride_ot + start + cols,
                 tl.math.div_rn(x, scale).to(out_ptr.dtype.element_ty), mask=mask)


def per_token_quant_fp8_triton(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """rows [m, k] -> (e4m3 values [m, k], float32 scales [m, 1]): per_token_quant_fp8_torch in
    one launch."""
    if rows.dim() != 2 or rows.stride(1) != 1:
        raise ValueError(f"rows: expected [m, k] with unit last stride, got shape "
                         f"{tuple(rows.shape)} strides {rows.stride()}")
    m, k = rows.shape
    quantized = torch.empty(m, k, dtype=quantized_dtype("fp8"), device=rows.device)
    scale = torch.empty(m, 1, dtype=torch.float32, device=rows.device)
    if m:
        _per_token_quant_fp8_kernel[(m,)](
            quantized, scale, rows, quantized.stride(0), rows.stride(0), K=k,
            BLOCK=min(2048, triton.next_power_of_2(k)), FP8_MAX=LARGEST["fp8"], num_warps=4)
    return quantized, scale
