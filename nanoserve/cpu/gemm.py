"""gemm.py: the CPU backend's products: how each Linear of the model multiplies on this machine.

Linear (layers.py) is y = x @ W.T + b, and its torch reference is F.linear. On a CPU the fastest way
to multiply depends on the processor, and the differences are large: oneDNN on a weight packed once
can run 2-3x faster than MKL (F.linear) for a decode step's few rows; bf16 is much faster than fp32
on a CPU with AVX512-BF16 and much SLOWER without it, where oneDNN refuses bf16 altogether
(scripts/results/README.md has the figures, with the CPU each was measured on). A rule tuned on one
CPU is wrong on another.

So no rule is hard-coded. At start-up `choose_cpu_gemms` times the candidate paths on the
model's real shapes and row counts, on this machine, and gives each Linear the fastest:

    torch          F.linear in the model dtype (MKL, or oneDNN inside torch for bf16)
    onednn         the weight packed once for oneDNN (torch.ops.mkldnn, as vLLM's CPU build
                   does), the product in the model dtype; bf16 only where oneDNN supports it
    onednn-fp32    for a bf16/fp16 model: the weight packed once in float32, the rows widened
                   on the fly. The same numbers as a bf16 product (bf16 x bf16 is exact in
                   float32, both sum in float32), at float32's speed, for float32's memory.
    kernel         nanoserve's own C product (csrc/gemm.c) on the weight packed once into its
                   panels, float32 or bf16: a library's small-row products can be far from the
                   peak (Zen 4: 1-64 rows 1.1-1.6x faster than oneDNN's; both at peak from 256).
    amx            bf16 on a CPU with AMX, the weight kept as it is: up to a row count measured at
                   start-up (`amx_loop_rows`) gemm.c's AMX loop, streaming it at near memory speed
                   (a decode step's rows), above it F.linear on the same tensor (prefill).
    --quantization int8: torch (dequantize, then F.linear), int8pack (torch's _weight_int8pack_mm)
    and kernel (gemm.c's gemm_int8, Int8KernelGemm); fp8: torch alone (no CPU multiplies fp8).

Each path is a `Gemm` whose `product(x)` is the Linear op's (what layers.Linear.forward_native
computes); a captured decode step replays the same calls (cpu/graphs.py).

    >>> choose_cpu_gemms(model, Config())                          # doctest: +SKIP
    ({<Linear>: <KernelGemm>, ...}, {'576x1536 float32': 'kernel', ...})

A Linear that takes a path other than torch's gives up its unpacked weight (the gemm holds what it
multiplies), so the weights take the same memory as before. `Config.cpu_gemm` forces one path.

Run the tests (each path equals F.linear for 1, 7, 64 and 300 rows):
    pytest -q tests/test_cpu_backend.py -k gemm
"""

from __future__ import annotations

import functools
import time
from typing import Callable, Iterable, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from nanoserve.config import Config
from nanoserve.cpu import kernels as cpu_kernels
from nanoserve.layers import Linear, gemm_label, model_dtype
from nanoserve.quantization import dequantize, quantize


class Gemm:
    """One Linear's product on one path. `product(x)`: x @ W.T + b."""

    def product(self, x: Tensor) -> Tensor:
        raise NotImplementedError


class TorchGemm(Gemm):
    """F.linear on the weight as it is (MKL; oneDNN inside torch for bf16)."""

    def __init__(self, weight: Tensor, bias: Optional[Tensor]):
        self.weight, self.bias = weight, bias
        self.nbytes = weight.numel() * weight.element_size()   # the weight it holds (no copy)

    def product(self, x: Tensor) -> Tensor:
        return F.linear(x, self.weight, self.bias)


class PackedGemm(Gemm):
    """x @ W.T + b with W packed once into oneDNN's blocked layout, in dtype `compute`."""

    def __init__(self, weight: Tensor, bias: Optional[Tensor], compute: torch.dtype):
        self.compute = compute
        # batch_size None: packed for any row count (a decode batch changes size every step).
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().to(compute), None)
        self.bias = None if bias is None else bias.detach().to(compute)
        self.nbytes = weight.numel() * compute.itemsize   # what the packed copy holds

    def product(self, x: Tensor) -> Tensor:
        y = torch.ops.mkldnn._linear_pointwise(x.to(self.compute), self.packed, self.bias,
                                               "none", [], "")
        return y.to(x.dtype)


class KernelGemm(Gemm):
    """x @ W.T + b with csrc/gemm.c, W packed once into its panels (cpu_kernels.gemm_pack)."""

    scales, register_rows = None, 0   # an int8 weight's (Int8KernelGemm)

    def __init__(self, weight: Tensor, bias: Optional[Tensor]):
        self.packed, self.bias = cpu_kernels.gemm_pack(weight.detach(), bias)
        self._finish(weight.shape)

    def _finish(self, shape) -> None:
        self.out_features, self.in_features = shape
        self.nbytes = self.packed.nbytes + (0 if self.scales is None else self.scales.nbytes)

    def product(self, x: Tensor) -> Tensor:
        return cpu_kernels.gemm(x, self.packed, self.bias, self.out_features, scales=self.scales,
                                register_rows=self.register_rows)


class Int8KernelGemm(KernelGemm):
    """gemm.c's product on an int8 weight (`--quantization int8`), packed once into the `kernel`
    path's panels, one byte an element, with a float32 scale per column. Up to `register_rows`
    rows (None: measured, int8_register_rows) the bytes meet x in registers (bf16 x as int16, as
    gemm.c says); above, a panel at a time widens into cache. `dtype`: the model's, which x must be."""

    def __init__(self, weight: Tensor, scale: Tensor, bias: Optional[Tensor], dtype: torch.dtype,
                 register_rows: Optional[int] = None):
        if dtype not in (torch.float32, torch.bfloat16):
            raise RuntimeError("the C int8 GEMM takes float32 or bf16 activations")
        self.dtype = dtype
        self.packed, self.scales, self.bias = cpu_kernels.gemm_pack_int8(
            weight.detach(), scale, bias, pairs=dtype == torch.bfloat16)
        self._finish(weight.shape)
        self.register_rows = register_rows if register_rows is not None else int8_register_rows(
            *weight.shape, dtype)

    def product(self, x: Tensor) -> Tensor:
        return super().product(x.to(self.dtype))


NO_ROW_LIMIT = 1 << 30   # more rows than any batch has


@functools.lru_cache(maxsize=None)
def int8_register_rows(out_features: int, in_features: int, dtype: torch.dtype,
                       probes=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512)) -> int:
    """The most rows up to which gemm.c's in-register int8 form beats its widened-panel form on
    this CPU: the last of `probes` before the first it loses (random int8 weight of this shape, the
    forms interleaved), or no limit if it never does (past 64 rows both repeat per 64-row block).
    VNNI and the vector width move it from CPU to CPU (a Zen 4 with VNNI: no limit)."""
    weight = torch.randint(-127, 128, (out_features, in_features), dtype=torch.int8)
    scale, rows = torch.rand(out_features), 0
    forms = {name: Int8KernelGemm(weight, scale, None, dtype, register_rows=limit).product
             for name, limit in (("registers", NO_ROW_LIMIT), ("panels", 0))}
    for m in probes:
        seconds = _interleaved_seconds(forms, torch.randn(m, in_features, dtype=dtype), 2)
        if seconds["registers"] > seconds["panels"]:
            return rows
        rows = m
    return NO_ROW_LIMIT


class DequantizeGemm(Gemm):
    """A quantized weight's torch reference (layers.Linear.forward_native): widened to the rows'
    dtype inside every product, then F.linear. The only CPU path for fp8 (no CPU fp8 product)."""
    def __init__(self, weight: Tensor, scale: Tensor, bias: Optional[Tensor]):
        self.weight, self.scale, self.bias = weight, scale, bias
        self.nbytes = weight.numel() + scale.numel() * 4

    def product(self, x: Tensor) -> Tensor:
        return F.linear(x, dequantize(self.weight, self.scale, x.dtype), self.bias)


class Int8PackGemm(Gemm):
    """torch's own int8 weight-only product, aten._weight_int8pack_mm (x in bf16 or float32, W int8
    [out, in], a scale per output channel). In bf16 it needs in_features a multiple of 32 (torch
    2.13: K = 8 crashes, K = 33 gives NaN), so it refuses other shapes."""
    def __init__(self, weight: Tensor, scale: Tensor, bias: Optional[Tensor], dtype: torch.dtype):
        if dtype not in (torch.float32, torch.bfloat16) or (dtype != torch.float32 and weight.shape[1] % 32):
            raise RuntimeError("_weight_int8pack_mm needs float32, or bf16 with in_features % 32 == 0")
        self.weight, self.dtype, self.bias = weight.contiguous(), dtype, bias
        self.scale, self.nbytes = scale.to(dtype), weight.numel() + scale.numel() * 4   # scales in x's dtype

    def product(self, x: Tensor) -> Tensor:
        y = torch.ops.aten._weight_int8pack_mm(x.reshape(-1, x.shape[-1]).to(self.dtype).contiguous(),
                                               self.weight, self.scale)
        return (y if self.bias is None else y + self.bias).view(*x.shape[:-1], y.shape[-1])


class AmxGemm(Gemm):
    """x @ W.T + b in bf16 with W as it is: up to `loop_rows` rows by gemm.c's AMX loop
    (cpu_kernels.gemm_amx), more by F.linear. `loop_rows` None: measured (amx_loop_rows)."""

    def __init__(self, weight: Tensor, bias: Optional[Tensor], loop_rows: Optional[int] = None):
        if weight.dtype != torch.bfloat16 or weight.shape[1] % 32 or not cpu_kernels.gemm_amx_ready():
            raise RuntimeError("the AMX product needs bf16, inputs a multiple of 32 and a CPU with AMX")
        self.weight, self.bias = weight.detach().contiguous(), bias
        self.bias_f32 = torch.zeros(weight.shape[0]) if bias is None else bias.detach().float()
        self.loop_rows = amx_loop_rows(*weight.shape) if loop_rows is None else loop_rows
        self.nbytes = weight.numel() * weight.element_size()   # the weight it holds (no copy)

    def product(self, x: Tensor) -> Tensor:
        # the AMX loop up to its rows (None: out of memory for its buffers), F.linear above them
        y = (cpu_kernels.gemm_amx(x, self.weight, self.bias_f32)
             if x.numel() <= self.loop_rows * x.shape[-1] else None)
        return F.linear(x, self.weight, self.bias) if y is None else y


def make_gemm(path: str, weight: Tensor, bias: Optional[Tensor], scale: Optional[Tensor] = None,
              dtype: Optional[torch.dtype] = None) -> Gemm:
    """The product of `weight` and `bias` along `path`. Raises RuntimeError where this machine
    cannot do it (oneDNN bf16 without AVX-512 or AVX-NE-CONVERT; no C compiler; no AMX).
    scale: `weight` is quantized (int8 or fp8, one scale per row) and `dtype` is the model's."""
    if scale is not None:
        if path == "kernel" and weight.dtype == torch.int8:
            return Int8KernelGemm(weight, scale, bias, dtype)
        if path == "int8pack" and weight.dtype == torch.int8:
            return Int8PackGemm(weight, scale, bias, dtype)
        if path == "torch":
            return DequantizeGemm(weight, scale, bias)
        raise RuntimeError(f"no {path} path for a {weight.dtype} weight")
    if path == "kernel":
        return KernelGemm(weight, bias)
    if path == "amx":
        return AmxGemm(weight, bias)
    if path == "torch":
        return TorchGemm(weight, bias)
    compute = torch.float32 if path == "onednn-fp32" else weight.dtype
    return PackedGemm(weight, bias, compute)


@functools.lru_cache(maxsize=None)
def amx_loop_rows(out_features: int, in_features: int, probes=(8, 16, 32, 64, 128, 256, 512)) -> int:
    """The most rows up to which gemm.c's AMX loop beats F.linear on this CPU: the last of
    `probes` before the first it loses (0: it loses at the first), timed on a random bf16 weight
    of this shape, the two interleaved. Measured once per shape, not assumed: where the library
    catches up depends on the CPU and the shape (Sapphire Rapids, 2 threads, the bench model's
    shapes: from 128 to 256 rows)."""
    weight = torch.randn(out_features, in_features, dtype=torch.bfloat16)
    zeros, rows = torch.zeros(out_features), 0
    paths = {"loop": lambda r: cpu_kernels.gemm_amx(r, weight, zeros),
             "torch": TorchGemm(weight, None).product}
    for m in probes:
        seconds = _interleaved_seconds(paths, torch.randn(m, in_features, dtype=torch.bfloat16), 2)
        if seconds["loop"] > seconds["torch"]:
            break
        rows = m
    return rows


def candidate_paths(dtype: torch.dtype, model_dtype: Optional[torch.dtype] = None) -> tuple[str, ...]:
    """The paths worth timing for weights of `dtype` (int8 or fp8: quantized, for activations of
    `model_dtype`) on a CPU. An fp8 weight has one, widened in the product: no CPU multiplies fp8."""
    if dtype == torch.int8:
        kernel = model_dtype in (torch.float32, torch.bfloat16) and cpu_kernels.load() is not None
        return ("torch", "int8pack") + (("kernel",) if kernel else ())
    if dtype.itemsize == 1:
        return ("torch",)
    paths = ["torch"]
    if torch.backends.mkldnn.is_available():
        paths += ["onednn", "onednn-fp32"] if dtype in (torch.bfloat16, torch.float16) else ["onednn"]
    if dtype in (torch.float32, torch.bfloat16) and cpu_kernels.load() is not None:
        paths.append("kernel")
    if dtype == torch.bfloat16 and cpu_kernels.gemm_amx_ready():
        paths.append("amx")
    return tuple(paths)


def _seconds(product: Callable[[Tensor], object], x: Tensor) -> float:
    start = time.perf_counter()
    product(x)
    return time.perf_counter() - start


def _best_seconds(product: Callable[[Tensor], object], x: Tensor, repeats: int) -> float:
    product(x)   # first call: oneDNN builds its kernel for this shape
    return min(_seconds(product, x) for _ in range(repeats))


def _interleaved_seconds(products: dict[str, Callable[[Tensor], object]], x: Tensor,
                         repeats: int) -> dict[str, float]:
    """Each product's best time on x, the products taking turns: a burst of other load hits
    every one alike."""
    seconds = {name: _best_seconds(product, x, 1) for name, product in products.items()}
    for _ in range(repeats):
        for name, product in products.items():
            seconds[name] = min(seconds[name], _seconds(product, x))
    return seconds


@torch.inference_mode()
def time_paths(weight: Tensor, bias: Optional[Tensor], rows: Iterable[int],
               paths: Iterable[str], repeats: int = 3, scale: Optional[Tensor] = None,
               dtype: Optional[torch.dtype] = None) -> dict[str, float]:
    """Each path's cost over `rows`: the sum over the row counts of its best time / the fastest
    path's (1.0 per row count: always the fastest; relative, so 512 rows do not drown out a 1-row
    decode). Paths this machine cannot run are left out. scale, dtype: a quantized weight's
    (make_gemm)."""
    gemms = {}
    for path in paths:
        try:
            gemms[path] = make_gemm(path, weight, bias, scale, dtype).product
        except RuntimeError:      # oneDNN without support for this dtype here
            continue
    cost = dict.fromkeys(gemms, 0.0)
    if len(gemms) <= 1:
        return cost
    for m in rows:
        seconds = _interleaved_seconds(gemms, torch.randn(m, weight.shape[1], dtype=dtype or weight.dtype), repeats)
        fastest = min(seconds.values())
        for path, s in seconds.items():
            cost[path] += s / fastest
    return cost


def timed_rows(most: int) -> list[int]:
    """The row counts a product is timed at, up to the most it will see."""
    return [m for m in (1, 8, 64, 512) if m <= most] or [most]


def choose_cpu_gemms(model, config: Config) -> tuple[dict, dict[str, str]]:
    """Give every Linear of `model` its fastest path on this CPU, timed once per distinct shape:
    the layers at up to a step's token budget, the LM head at the rows that sample. A path named
    by `config.cpu_gemm` skips the timing (torch's where it cannot run here). Returns
    ({Linear: Gemm}, {'in x out dtype': path}) (bench's)."""
    gemms, labels = {}, {}
    dtype = model_dtype(model)    # the activations'
    for layer in model.modules():
        if not isinstance(layer, Linear):
            continue
        w = layer.weight.detach()
        scale = layer.weight_scale if layer.quantization else None
        rows = timed_rows(config.max_num_seqs if layer is model.lm_head else config.max_num_batched_tokens)
        path = choose_path(labels, gemm_label(layer, w.dtype), w, layer.bias, scale, dtype, rows, config)
        gemms[layer] = make_gemm(path, w, layer.bias, scale, dtype)
    return gemms, labels


def choose_path(labels: dict[str, str], label: str, weight: Tensor, bias: Optional[Tensor],
                scale: Optional[Tensor], dtype: torch.dtype, rows: list[int], config: Config) -> str:
    """`label`'s path in `labels`, timed on `weight` (make_gemm's arguments) and added there the
    first time a label is seen: one path per label, so what bench reports is what every product
    of that shape runs (the Linears here, FusedMoE's experts in moe.py)."""
    if label not in labels:
        paths = candidate_paths(weight.dtype, dtype)
        if config.cpu_gemm != "auto":
            paths = [p for p in paths if p == config.cpu_gemm] or ["torch"]
        cost = time_paths(weight, bias, rows, paths, scale=scale, dtype=dtype) or {"torch": 0.0}
        labels[label] = min(cost, key=cost.get)
    return labels[label]


def gemm_peak(path: str, dtype: torch.dtype, shapes: Iterable[tuple[int, int]], rows: int = 512,
              device: str = "cpu", repeats: int = 3, quantization: Optional[str] = None) -> float:
    """The best sustained FLOP/s of `path` (on CUDA: cuBLAS, F.linear) over the (in, out) weight
    shapes given, `rows` rows each: the ceiling the model's own products are measured against
    (`nanoserve bench`). The model's own shapes, because a square 2048^3 product can run slower
    (or faster) than the shapes the model actually multiplies. quantization: on such weights."""
    best = 0.0
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)
    for in_features, out_features in shapes:
        weight, scale = torch.randn(out_features, in_features, dtype=dtype, device=device), None
        if quantization:
            weight, scale = quantize(weight, quantization)
        gemm = make_gemm(path if weight.device.type == "cpu" else "torch", weight, None, scale, dtype)
        x = torch.randn(rows, in_features, dtype=dtype, device=device)
        seconds = _best_seconds(lambda r: (gemm.product(r), sync()), x, repeats)
        best = max(best, 2 * rows * in_features * out_features / seconds)
    return best
