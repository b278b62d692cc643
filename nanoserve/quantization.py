"""quantization.py: weight-only quantization at load (`--quantization int8|fp8`, nanoserve's).

vLLM 0.32.0 has no int8 for dense Linears; its fp8 at load (fp8_per_tensor, fp8_per_channel) also
quantizes activations, and gathers each layer in full precision before quantizing it. Here the
config is fixed before anything loads, the model is built with int8 (or fp8) Linear weights, and
each tensor-parallel rank quantizes its slice of each checkpoint tensor as it reads it (models/
llama.py `load_weights`): one tensor, never a layer, in full precision. Every Linear but the LM
head (kept in the model dtype, as vLLM does by default; `--quantize-lm-head` quantizes it too, as
llama.cpp's quantized models have it) and the embedding (a lookup, not a product) is quantized.

One symmetric scale per output channel (row of W), so that w ~ q * scale[row]:

    int8   scale = max|row| / 127, q = round(w / scale)      in [-127, 127]
    fp8    scale = max|row| / 448, q = float8_e4m3fn(w / scale)   (448: e4m3's largest)

    >>> q, scale = quantize(torch.tensor([[1.0, -0.5], [0.0, 0.25]]), "int8")
    >>> q.tolist(), [round(s * 127, 4) for s in scale.tolist()]
    ([[127, -64], [0, 127]], [1.0, 0.25])

Activations stay in the model dtype but in the GPU's fp8 product: the torch reference
(layers.Linear.forward_native) dequantizes and multiplies in the model dtype; the backends are
faster (cpu/gemm.py: gemm.c widens int8 in its registers, multiplies bf16 rows as int16 scaled by
a power of two, exact within 2^7 of a row's largest; cuda/quantized.py: torch._scaled_mm, a step's
rows quantized to fp8 per token). Under TP a row-parallel rank's scale is that of its own columns.

    pytest -q tests/test_quantization.py

Lesson: lessons/06-length-and-memory.md
"""

from __future__ import annotations

import functools
import logging
from typing import Optional

import torch
from torch import Tensor

from nanoserve.config import QUANTIZATION_METHODS

LARGEST = {"int8": 127.0, "fp8": 448.0}    # the largest magnitude each format holds


def quantized_dtype(method: str) -> torch.dtype:
    return torch.int8 if method == "int8" else getattr(torch, "float8_e4m3fn")


def quantize(weight: Tensor, method: str) -> tuple[Tensor, Tensor]:
    """weight [out, in] -> (q [out, in] int8 or float8_e4m3fn, scale [out] float32)."""
    w = weight.float()
    # A row of zeros gets a tiny scale instead of 0, so q stays 0 and never NaN.
    scale = w.abs().amax(dim=1).clamp(min=1e-12) / LARGEST[method]
    q = w / scale[:, None]
    q = q.round_().clamp_(-127, 127).to(torch.int8) if method == "int8" else q.to(quantized_dtype(method))
    return q, scale


def dequantize(q: Tensor, scale: Tensor, dtype: torch.dtype) -> Tensor:
    """q * scale per row, in `dtype`: the weight the torch reference multiplies by."""
    return (q.float() * scale[:, None]).to(dtype)


def check_quantization(method: Optional[str], hf_config, device: torch.device) -> None:
    """ValueError, before anything loads, for a checkpoint already quantized in a format nanoserve
    does not read (config.json `quantization_config`: GPTQ, AWQ, fp8 checkpoints...), or fp8 where
    this torch cannot hold float8_e4m3fn tensors on `device`."""
    given = getattr(hf_config, "quantization_config", None)
    if given:
        kind = given.get("quant_method", "?") if isinstance(given, dict) else getattr(given, "quant_method", "?")
        raise ValueError(f"the checkpoint is already quantized (config.json quantization_config, "
                         f"quant_method {kind!r}): nanoserve reads unquantized checkpoints and "
                         f"quantizes them itself at load (quantization: {', '.join(QUANTIZATION_METHODS)})")
    if method == "fp8":
        try:
            torch.zeros(2, device=device).to(quantized_dtype("fp8")).float()
        except (AttributeError, RuntimeError, TypeError) as e:
            raise ValueError(f"quantization 'fp8': torch {torch.__version__} cannot hold "
                             f"float8_e4m3fn tensors on {device} ({type(e).__name__}: {e}); "
                             "use quantization 'int8'") from None


def log_widening(gemm_paths: dict[str, str]) -> None:
    """One line, once the backend is bound (ModelRunner), where fp8 weights are widened to the
    model dtype inside the product (no fp8 product on this device): the memory is saved, the
    speed is the model dtype's, or worse."""
    widened = [label for label, path in gemm_paths.items() if "float8" in label and path != "scaled_mm"]
    if widened:
        _log_once(f"quantization fp8: no fp8 product on this device, so {len(widened)} product "
                  "shape(s) widen their fp8 weights to the model dtype inside the product")


@functools.lru_cache(maxsize=None)
def _log_once(line: str) -> None:
    logging.getLogger("nanoserve").warning(line)


def quantized_weight_bytes(model, dtype: torch.dtype) -> int:
    """The bytes the weights of `model` (built with its quantization, e.g. on the "meta" device)
    take once loaded in `dtype`: quantized weights at 1 byte each plus their float32 scales,
    every other parameter in `dtype`. `nanoserve memory` sizes with it. A quantized weight `w`
    keeps its scales beside it in the buffer `w_scale` (Linear's weight_scale, FusedMoE's
    w13_weight_scale and w2_weight_scale)."""
    quantized = (torch.int8, getattr(torch, "float8_e4m3fn", torch.int8))
    total = sum(p.numel() * (1 if p.dtype in quantized else dtype.itemsize) for p in model.parameters())
    return total + sum(b.numel() * 4 for name, b in model.named_buffers() if name.endswith("weight_scale"))
