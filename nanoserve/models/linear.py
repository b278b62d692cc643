"""linear.py: every matrix product of the model, and how each one runs on this machine's CPU.

`Linear` is nn.Linear's y = x @ W.T + b with HF's [out, in] weight layout. On CUDA it calls
F.linear (cuBLAS). On a CPU the fastest way to multiply depends on the processor, and the
differences are large: measured with torch 2.13, 2 threads, 576 x 1536 fp32, 8 to 64 rows,
oneDNN on a weight packed once runs 2-3x faster than MKL (F.linear) on an AMD Zen 5; bf16 there
is 4x faster than fp32, but on a CPU without AVX-512 (Zen 3) torch's bf16 product is ~8x SLOWER
than fp32 and oneDNN refuses bf16 altogether. A rule tuned on one of them is wrong on the other.

So no rule is hard-coded. At start-up `choose_cpu_gemms` times the candidate paths on the
model's real shapes and row counts, on this machine, and gives each Linear the fastest:

    torch          F.linear in the model dtype (MKL, or oneDNN inside torch for bf16)
    onednn         the weight packed once for oneDNN (torch.ops.mkldnn, as vLLM's CPU build
                   does), the product in the model dtype; bf16 only where oneDNN supports it
    onednn-fp32    for a bf16/fp16 model: the weight packed once in float32, the rows widened
                   on the fly. The same numbers as a bf16 product (bf16 x bf16 is exact in
                   float32, both sum in float32), at float32's speed, for float32's memory.
    kernel         nanoserve's own C product (csrc/gemm.c, built with the other CPU kernels) on
                   the weight packed once into its panels, float32 or bf16. A library's small-row
                   products can be far from the peak: on a Zen 4, 1 to 64 rows ran 1.1-1.6x
                   faster here than in oneDNN, and both ran at the peak from 256 rows.
    amx            bf16 on a CPU with AMX: the weight kept as it is. Up to a row count measured
                   at start-up (`amx_loop_rows`) gemm.c's AMX loop, which streams the weight at
                   near memory speed (a decode step's 1-64 rows), above it F.linear on the same
                   tensor (prefill). One copy of the weight serves both. The loop ends gate_up in
                   silu(gate) * up itself, as the kernel path does.

    >>> layer = Linear(4, 3, bias=False)
    >>> choose_cpu_gemms([layer], rows=[1, 8])                     # doctest: +SKIP
    {'4x3 float32': 'onednn'}

A packed Linear drops its unpacked weight (unless it is shared, as a tied LM head is), so the
weights take the same memory as before. `Config.cpu_gemm` forces one path (for comparisons).

Run the tests (each path equals F.linear for 1, 7, 64 and 300 rows):
    pytest -q tests/test_models.py -k gemm
"""

from __future__ import annotations

import functools
import time
from typing import Callable, Iterable, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from nanoserve.cpu import kernels as cpu_kernels

Gemm = Callable[[Tensor], Tensor]
CPU_GEMM_PATHS = ("torch", "onednn", "onednn-fp32", "kernel", "amx")


class Linear(nn.Module):
    """y = x @ W.T + b. `weight` is [out_features, in_features], as in HF checkpoints.

    `gemm` is the product to call; F.linear until `choose_cpu_gemms` picks a packed path.
    silu_and_mul: the layer is an MLP's gate_up (gate rows, then up rows) and returns
    silu(gate) * up [..., out_features // 2]; on the `kernel` path, and on the `amx` path up to its
    loop's row count, gemm.c applies it to the product's sums, so gate_up is never stored
    (elsewhere it is a pass after the product).
    forward's `norm` (an RMSNorm) and `residual`: multiply norm(x, residual) instead of x (the
    residual updated in place to x + residual, as the norm does); on the `kernel` path, and on
    the `amx` path up to its loop's row count, gemm.c normalises the rows as it copies them, so
    they are never stored either."""

    def __init__(self, in_features: int, out_features: int, bias: bool, silu_and_mul: bool = False):
        super().__init__()
        self.in_features, self.out_features, self.silu_and_mul = in_features, out_features, silu_and_mul
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None
        self.gemm: Optional[Gemm] = None

    def forward(self, x: Tensor, norm: Optional[nn.Module] = None,
                residual: Optional[Tensor] = None) -> Tensor:
        if norm is not None:
            if getattr(self.gemm, "normalises", False):   # gemm.c's: the rows as it copies them
                return self.gemm(x, norm, residual)
            x = apply_norm(norm, x, residual)
        if self.gemm is not None:
            return self.gemm(x)
        return after_product(F.linear(x, self.weight, self.bias), self.silu_and_mul)

    # Called straight, not through nn.Module.__call__, which looks for hooks (nanoserve has none) at
    # every call: ~1.5 us, seven calls a layer, with Python's caches cold after each C kernel.
    __call__ = forward

    def use_gemm(self, path: str, keep_weight: bool) -> None:
        """Multiply with `path` from now on; drop the unpacked weight unless it is needed."""
        if path == "torch":
            self.gemm = None
            return
        self.gemm = make_gemm(path, self.weight.detach(), self.bias, self.silu_and_mul)
        if not keep_weight:   # the packed copy replaces it: same memory as before packing
            self.weight = None


def apply_norm(norm: nn.Module, x: Tensor, residual: Optional[Tensor]) -> Tensor:
    """norm(x), or with the residual norm(x + residual), the residual updated in place."""
    return norm(x) if residual is None else norm(x, residual)[0]


def after_product(y: Tensor, silu_and_mul: bool) -> Tensor:
    """A gate_up product's silu(gate) * up where the layer has it; any other product as it is."""
    return apply_silu_and_mul(y) if silu_and_mul else y


def apply_silu_and_mul(gate_up: Tensor) -> Tensor:
    """silu(gate) * up from a gate_up product [..., 2 * intermediate], gate first (HF's
    act_fn(gate) * up): csrc/silu_and_mul.c's one pass where the CPU kernels run, else torch."""
    out = cpu_kernels.silu_and_mul(gate_up)
    if out is None:
        gate, up = gate_up.chunk(2, dim=-1)
        out = F.silu(gate) * up
    return out


def make_gemm(path: str, weight: Tensor, bias: Optional[Tensor], silu_and_mul: bool = False) -> Gemm:
    """The product x -> x @ weight.T + bias along `path` (silu_and_mul: then silu(gate) * up of
    it, as Linear's). Raises RuntimeError where this machine's oneDNN cannot do it (e.g. bf16
    without AVX-512 or AVX-NE-CONVERT)."""
    if path == "kernel":
        return KernelGemm(weight, bias, silu_and_mul)
    if path == "torch":
        gemm = lambda x: F.linear(x, weight, bias)   # noqa: E731
    elif path == "amx":
        return AmxGemm(weight, bias, silu_and_mul=silu_and_mul)   # applies it itself
    else:
        gemm = PackedGemm(weight, bias, torch.float32 if path == "onednn-fp32" else weight.dtype)
    return SiluAndMulAfter(gemm) if silu_and_mul else gemm


class SiluAndMulAfter:
    """A product, then apply_silu_and_mul on it: the paths whose product cannot end in it."""

    def __init__(self, gemm: Gemm):
        self.gemm, self.nbytes = gemm, getattr(gemm, "nbytes", 0)   # F.linear's holds nothing
        self.normalises = getattr(gemm, "normalises", False)

    def __call__(self, x: Tensor, *norm_and_residual) -> Tensor:
        return apply_silu_and_mul(self.gemm(x, *norm_and_residual))


class PackedGemm:
    """x @ W.T + b with W packed once into oneDNN's blocked layout, in dtype `compute`."""

    def __init__(self, weight: Tensor, bias: Optional[Tensor], compute: torch.dtype):
        self.compute = compute
        # batch_size None: packed for any row count (a decode batch changes size every step).
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().to(compute), None)
        self.bias = None if bias is None else bias.detach().to(compute)
        self.nbytes = weight.numel() * compute.itemsize   # what the packed copy holds

    def __call__(self, x: Tensor) -> Tensor:
        y = torch.ops.mkldnn._linear_pointwise(x.to(self.compute), self.packed, self.bias,
                                               "none", [], "")
        return y.to(x.dtype)


class KernelGemm:
    """x @ W.T + b with csrc/gemm.c, W packed once into its panels (cpu_kernels.gemm_pack);
    silu_and_mul: silu(gate) * up of it, in the same pass."""
    normalises = True   # takes Linear's norm and residual (see cpu_kernels.gemm)

    def __init__(self, weight: Tensor, bias: Optional[Tensor], silu_and_mul: bool = False):
        self.packed, self.bias = cpu_kernels.gemm_pack(weight.detach(), bias, silu_and_mul)
        self.silu_and_mul = silu_and_mul
        self.out_features = weight.shape[0] // 2 if silu_and_mul else weight.shape[0]
        self.nbytes = self.packed.numel() * self.packed.element_size()

    def __call__(self, x: Tensor, norm: Optional[nn.Module] = None,
                 residual: Optional[Tensor] = None) -> Tensor:
        """norm (an RMSNorm), residual: see cpu_kernels.gemm."""
        return cpu_kernels.gemm(x, self.packed, self.bias, self.out_features, self.silu_and_mul,
                                norm, residual)


class AmxGemm:
    """x @ W.T + b in bf16 with W as it is: up to `loop_rows` rows by gemm.c's AMX loop
    (cpu_kernels.gemm_amx), more by F.linear. `loop_rows` None: measured (amx_loop_rows).
    silu_and_mul: W is gate_up, and the result silu(gate) * up: the loop applies it to its sums
    (gate_up is never stored), after F.linear it is apply_silu_and_mul's pass."""
    normalises = True

    def __init__(self, weight: Tensor, bias: Optional[Tensor], loop_rows: Optional[int] = None,
                 silu_and_mul: bool = False):
        if weight.dtype != torch.bfloat16 or weight.shape[1] % 32 or not cpu_kernels.gemm_amx_ready():
            raise RuntimeError("the AMX product needs bf16, inputs a multiple of 32 and a CPU with AMX")
        self.weight, self.bias, self.silu_and_mul = weight.detach().contiguous(), bias, silu_and_mul
        self.bias_f32 = torch.zeros(weight.shape[0]) if bias is None else bias.detach().float()
        self.loop_rows = amx_loop_rows(*weight.shape, silu_and_mul) if loop_rows is None else loop_rows
        self.nbytes = weight.numel() * weight.element_size()   # the weight it holds

    def __call__(self, x: Tensor, norm: Optional[nn.Module] = None,
                 residual: Optional[Tensor] = None) -> Tensor:
        """norm (an RMSNorm), residual: see cpu_kernels.gemm; the loop normalises its rows as it
        copies them, F.linear's are normalised first."""
        if x.numel() <= self.loop_rows * x.shape[-1]:
            y = cpu_kernels.gemm_amx(x, self.weight, self.bias_f32, norm, residual, self.silu_and_mul)
            if y is not None:    # None: out of memory for its buffers
                return y
        y = F.linear(x if norm is None else apply_norm(norm, x, residual), self.weight, self.bias)
        return after_product(y, self.silu_and_mul)


@functools.lru_cache(maxsize=None)
def amx_loop_rows(out_features: int, in_features: int, silu_and_mul: bool = False,
                  probes=(8, 16, 32, 64, 128, 256, 512)) -> int:
    """The most rows up to which gemm.c's AMX loop beats F.linear on this CPU: the last of
    `probes` before the first it loses (0: it loses at the first), timed on a random bf16 weight
    of this shape, the two interleaved (silu_and_mul: each ending in it, as the layer does).
    Measured once per shape, not assumed: where the library catches up depends on the CPU and the
    shape (Sapphire Rapids, 2 threads, the bench model's shapes: from 128 to 256 rows, gate_up
    with silu_and_mul 512)."""
    weight = torch.randn(out_features, in_features, dtype=torch.bfloat16)
    zeros, rows = torch.zeros(out_features), 0
    paths = {"loop": lambda r: cpu_kernels.gemm_amx(r, weight, zeros, silu_and_mul=silu_and_mul),
             "torch": lambda r: after_product(F.linear(r, weight), silu_and_mul)}
    for m in probes:
        seconds = _interleaved_seconds(paths, torch.randn(m, in_features, dtype=torch.bfloat16), 2)
        if seconds["loop"] > seconds["torch"]:
            break
        rows = m
    return rows


def candidate_paths(dtype: torch.dtype) -> tuple[str, ...]:
    """The paths worth timing for weights of `dtype` on a CPU."""
    paths = ["torch"]
    if torch.backends.mkldnn.is_available():
        paths += ["onednn", "onednn-fp32"] if dtype in (torch.bfloat16, torch.float16) else ["onednn"]
    if dtype in (torch.float32, torch.bfloat16) and cpu_kernels.load() is not None:
        paths.append("kernel")
    if dtype == torch.bfloat16 and cpu_kernels.gemm_amx_ready():
        paths.append("amx")
    return tuple(paths)


def _seconds(gemm: Gemm, x: Tensor) -> float:
    start = time.perf_counter()
    gemm(x)
    return time.perf_counter() - start


def _best_seconds(gemm: Gemm, x: Tensor, repeats: int) -> float:
    gemm(x)   # first call: oneDNN builds its kernel for this shape
    return min(_seconds(gemm, x) for _ in range(repeats))


def _interleaved_seconds(gemms: dict[str, Gemm], x: Tensor, repeats: int) -> dict[str, float]:
    """Each product's best time on x, the products taking turns: a burst of other load hits
    every one alike."""
    seconds = {name: _best_seconds(gemm, x, 1) for name, gemm in gemms.items()}
    for _ in range(repeats):
        for name, gemm in gemms.items():
            seconds[name] = min(seconds[name], _seconds(gemm, x))
    return seconds


@torch.inference_mode()
def time_paths(weight: Tensor, bias: Optional[Tensor], rows: Iterable[int],
               paths: Iterable[str], repeats: int = 3, silu_and_mul: bool = False) -> dict[str, float]:
    """Each path's cost over `rows`: the sum, over the row counts, of its best time divided by
    the fastest path's (1.0 per row count = always the fastest), silu_and_mul included where the
    layer has it. Paths this machine cannot run are left out. Relative, so a 512-row product
    does not drown out the 1-row decode."""
    gemms = {}
    for path in paths:
        try:
            gemms[path] = make_gemm(path, weight, bias, silu_and_mul)
        except RuntimeError:      # oneDNN without support for this dtype here
            continue
    cost = dict.fromkeys(gemms, 0.0)
    if len(gemms) <= 1:
        return cost
    for m in rows:
        seconds = _interleaved_seconds(gemms, torch.randn(m, weight.shape[1], dtype=weight.dtype), repeats)
        fastest = min(seconds.values())
        for path, s in seconds.items():
            cost[path] += s / fastest
    return cost


def choose_cpu_gemms(layers: Iterable[tuple[Linear, Iterable[int]]], forced: str = "auto",
                     shared: frozenset = frozenset()) -> dict[str, str]:
    """Give every (Linear, the row counts it will see) its fastest path on this CPU, timed once
    per distinct shape. `forced` (a path name) skips the timing; where that path cannot run
    here, the layer keeps torch's.
    `shared`: ids of weights that other modules also use (kept unpacked). Returns
    {'in x out dtype': path}, which `nanoserve bench` prints."""
    chosen: dict[tuple, str] = {}
    for layer, rows in layers:
        w = layer.weight
        key = (w.shape[1], w.shape[0], w.dtype, layer.bias is not None, layer.silu_and_mul)
        if key not in chosen:
            paths = candidate_paths(w.dtype)
            if forced != "auto":
                paths = [p for p in paths if p == forced] or ["torch"]
            cost = (time_paths(w.detach(), layer.bias, rows, paths, silu_and_mul=layer.silu_and_mul)
                    or {"torch": 0.0})
            chosen[key] = min(cost, key=cost.get)
        layer.use_gemm(chosen[key], keep_weight=id(w) in shared)
    return {f"{i}x{o} {str(d).removeprefix('torch.')}{' silu_and_mul' if act else ''}": path
            for (i, o, d, _, act), path in chosen.items()}


def gemm_peak(path: str, dtype: torch.dtype, shapes: Iterable[tuple[int, int]], rows: int = 512,
              device: str = "cpu", repeats: int = 3) -> float:
    """The best sustained FLOP/s of `path` (on CUDA: cuBLAS, F.linear) over the (in, out) weight
    shapes given, `rows` rows each: the ceiling the model's own products are measured against
    (`nanoserve bench`). The model's own shapes, because a square 2048^3 product can run slower
    (or faster) than the shapes the model actually multiplies."""
    best = 0.0
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)
    for in_features, out_features in shapes:
        weight = torch.randn(out_features, in_features, dtype=dtype, device=device)
        gemm = make_gemm(path if weight.device.type == "cpu" else "torch", weight, None)
        x = torch.randn(rows, in_features, dtype=dtype, device=device)
        seconds = _best_seconds(lambda r: (gemm(r), sync()), x, repeats)
        best = max(best, 2 * rows * in_features * out_features / seconds)
    return best
