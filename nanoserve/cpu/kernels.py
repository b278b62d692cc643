"""kernels.py: the CPU backend's small C kernels (csrc/): build, load, call.

Each does in one pass over memory what torch does in several, and each is tested against the torch
reference it replaces (layers.py, paged_attention.py):
    decode_attention.c   decode tokens (one new token per request), reading K/V in place through
                         the block tables: decode is memory-bound, so reading the cache once is the
                         point (the torch reference gathers each request's blocks into a copy).
    prefill_attention.c  every other request (prefill, chunked prefill, prefix hit): compute-bound,
                         a flash-attention loop with the query tokens in the vector lanes; on a
                         CPU with AMX (bf16), its two products in AMX tiles.
    rms_norm.c           the residual add and the RMSNorm after it, with HF's roundings.
    rope.c               RoPE on q and k, and k and v stored into the KV cache, in one pass.
    silu_and_mul.c       the MLP's silu(gate) * up, into the contiguous rows down_proj reads.
    argmax.c             each row's argmax (greedy sampling), float32 or bf16 logits, vectorised,
                         where torch's goes one float at a time.
    gemm.c               a Linear's product on its weight packed once (cpu/gemm.py's `kernel`
                         path). The same on an int8 weight (`--quantization int8`): gemm_int8.
                         With AMX, also a bf16 product on the weight as it is (the `amx` path),
                         and a FusedMoE layer's experts on it in one call (moe_amx).

What each was measured to gain, and on which CPU: scripts/results/README.md.

The kernels are compiled on first use with the system C compiler (`$CC`, else `cc`), with
-march=native for this machine's vector units and OpenMP for its cores, into a cache directory
keyed by the source, the flags and the CPU; later processes just load it. Without a compiler, or
on a platform where the build fails, `load()` returns None and every caller keeps its torch path
(one warning). NANOSERVE_CPU_KERNEL=0 in the environment keeps them off (to compare the two paths);
NANOSERVE_CPU_MARCH=x86-64-v3 (any -march) builds them as for another machine (here: AVX2 loops).

    from nanoserve.cpu.kernels import load
    kernels = load()         # the ctypes library (.decode_attention, .rms_norm, ...), or None

Tests: pytest -q tests/test_cpu_backend.py   (against the torch reference)
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Optional

import torch
from torch import Tensor

CSRC = Path(__file__).parent / "csrc"
SOURCES = [CSRC / name for name in ("decode_attention.c", "prefill_attention.c", "rms_norm.c", "rope.c",
                                     "silu_and_mul.c", "argmax.c", "gemm.c")]
HEADER = CSRC / "cpu_kernels.h"
# The kernels a model step calls (graphs.py records these while it captures a step).
STEP_KERNELS = ("decode_attention", "prefill_attention", "rms_norm", "rope_store_kv", "silu_and_mul",
                "gemm", "gemm_int8", "gemm_amx")
FLAGS = ["-O3", f"-march={os.environ.get('NANOSERVE_CPU_MARCH', 'native')}", "-fopenmp", "-fPIC", "-Werror",
         # Vectorised dot products (float sums reassociated) and expf (glibc's vector libmvec).
         "-ffast-math"]
# Linked in a second step without -ffast-math: linking with it adds crtfastmath.o (GCC 12),
# which turns on flush-to-zero for the WHOLE process as the library loads, so every float
# below 1.2e-38 in the user's torch and numpy code would silently become 0.
LINK_FLAGS = ["-shared", "-fopenmp"]


def cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(root) / "nanoserve"


def _cpu_flags() -> bytes:
    try:
        return next(line for line in Path("/proc/cpuinfo").read_bytes().splitlines()
                    if line.startswith(b"flags"))
    except (OSError, StopIteration):
        return b""


@functools.lru_cache(maxsize=1)
def load():
    """The compiled kernels as a ctypes library, or None when they cannot be built here."""
    if not sys.platform.startswith("linux") or os.environ.get("NANOSERVE_CPU_KERNEL") == "0":
        return None
    source = b"".join(path.read_bytes() for path in [HEADER, *SOURCES])
    compiler = os.environ.get("CC", "cc")
    # -march=native code is only good on this kind of CPU: a home directory shared between
    # machines must not hand one machine's build to another, so the CPU's flags are in the key.
    key = hashlib.sha256(source + " ".join([compiler] + FLAGS + LINK_FLAGS).encode()
                         + _cpu_flags()).hexdigest()[:16]
    library = cache_dir() / f"cpu_kernels-{key}.so"
    try:
        if not library.is_file():
            library.parent.mkdir(parents=True, exist_ok=True)
            # Build beside the target and rename: concurrent first runs never load half a file.
            with tempfile.TemporaryDirectory(dir=library.parent) as tmp:
                built, objects = Path(tmp) / library.name, [Path(tmp) / f"{s.stem}.o" for s in SOURCES]
                for source_file, obj in zip(SOURCES, objects):
                    subprocess.run([compiler, *FLAGS, "-c", str(source_file), "-o", str(obj)],
                                   check=True, capture_output=True, text=True)
                subprocess.run([compiler, *LINK_FLAGS, *map(str, objects), "-o", str(built), "-lm"],
                               check=True, capture_output=True, text=True)
                os.replace(built, library)
        kernels = ctypes.CDLL(str(library))
    except (OSError, subprocess.CalledProcessError) as e:
        detail = getattr(e, "stderr", None) or e
        warnings.warn(f"nanoserve: the CPU kernels could not be built ({detail}); "
                      f"using the slower torch paths")
        return None
    # The attention kernels take: query, out, k_cache, v_cache, then their int32 arrays, then the
    # sizes, scale, bf16 and the thread count.
    for fn, arrays, sizes in ((kernels.decode_attention, 3, 6), (kernels.prefill_attention, 4, 6)):
        fn.restype = ctypes.c_int
        fn.argtypes = ([ctypes.c_void_p] * (4 + arrays) + [ctypes.c_int] * sizes + [ctypes.c_float]
                       + [ctypes.c_int] * 2)
    kernels.rms_norm.restype = None
    kernels.rms_norm.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int] * 2 + [ctypes.c_float] + [ctypes.c_int] * 2
    kernels.rope_store_kv.restype = None
    kernels.rope_store_kv.argtypes = [ctypes.c_void_p] * 7 + [ctypes.c_int] * 6
    kernels.silu_and_mul.restype = None
    kernels.silu_and_mul.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int] * 4
    kernels.argmax.restype = None
    kernels.argmax.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int, ctypes.c_int64] + [ctypes.c_int] * 2
    kernels.gemm_pack.restype = None
    kernels.gemm.restype = ctypes.c_int
    kernels.gemm_pack.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int] * 3
    # x, packed, bias, y, then M, N, K, bf16 (gemm_int8: then scales, register_rows), threads
    kernels.gemm.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int] * 5
    kernels.gemm_int8.restype = ctypes.c_int
    kernels.gemm_int8.argtypes = kernels.gemm.argtypes[:-1] + [ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
    kernels.gemm_amx_ready.restype = kernels.gemm_amx.restype = ctypes.c_int
    kernels.gemm_amx_ready.argtypes = []
    kernels.gemm_amx.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int] * 4
    kernels.moe_amx.restype = ctypes.c_int
    kernels.moe_amx.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int] * 3 + [ctypes.c_void_p] * 4 + [ctypes.c_int] * 3
    return kernels


def _takes(*tensors: Tensor) -> bool:
    """Whether the kernels can read these tensors: on the CPU, contiguous, all float32 or all bf16
    (before every kernel call: `is_cpu` and a list take half the time of device.type and all())."""
    dtype = tensors[0].dtype
    return (tensors[0].is_cpu and dtype in (torch.float32, torch.bfloat16)
            and not [t for t in tensors if t.dtype != dtype or not t.is_contiguous()])


def attention_kernel(name: str, query: Tensor, out: Tensor, k_cache: Tensor, v_cache: Tensor,
                     requests, scale: float) -> bool:
    """Run kernel `name` ("decode_attention" or "prefill_attention") for `requests` (a
    cpu/ops.py's RequestGroup: contiguous int32 tensors) into `out`. Returns False when the
    kernels are unavailable, the tensors are outside what they support, or a kernel ran out of
    memory; the caller then uses the torch path for those requests."""
    kernels = load()
    if kernels is None or not _takes(query, out, k_cache, v_cache):
        return False
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    query_start, query_len, block_tables, seq_lens, count, max_blocks = requests.arguments
    # A decode's one token is at its query_start; the prefill kernel also needs the lengths.
    arrays = ((query_start, block_tables, seq_lens) if name == "decode_attention"
              else (query_start, query_len, block_tables, seq_lens))
    status = getattr(kernels, name)(
        query.data_ptr(), out.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), *arrays, count,
        max_blocks, block_size, num_kv_heads, query.shape[1] // num_kv_heads, head_dim, scale,
        int(query.dtype == torch.bfloat16), torch.get_num_threads())
    return status == 0


def rms_norm(x: Tensor, residual: Optional[Tensor], weight: Tensor, eps: float) -> Optional[Tensor]:
    """rms_norm.c: RMSNorm of x over its last dimension, or of x + residual when a residual is
    given (the residual is then updated in place to that sum, as vLLM's fused_add_rms_norm does).
    None where the kernel cannot run here; the caller then uses torch."""
    kernels = load()
    if kernels is None or not _takes(x, weight, *([] if residual is None else [residual])):
        return None
    out = torch.empty_like(x)
    kernels.rms_norm(x.data_ptr(), None if residual is None else residual.data_ptr(),
                     weight.data_ptr(), out.data_ptr(), x.numel() // x.shape[-1], x.shape[-1], eps,
                     int(x.dtype == torch.bfloat16), torch.get_num_threads())
    return out


def rope_store_kv(qkv: Tensor, rope: tuple[Tensor, Tensor], slot_mapping: Tensor, k_cache: Tensor,
                  v_cache: Tensor, num_heads: int) -> Optional[Tensor]:
    """rope.c: from the fused qkv rows [tokens, (heads + 2 kv_heads) * head_dim], RoPE on q and k
    (`rope`: the step's cos, sin, as RotaryEmbedding gives them), k and v written into the caches at
    `slot_mapping`. Returns q rotated [tokens, heads, head_dim], or None where the kernel cannot
    run here (the caller then does it in torch)."""
    kernels = load()
    cos, sin = rope
    if kernels is None or not _takes(qkv, cos, sin, k_cache, v_cache):
        return None
    num_tokens, (_, _, num_kv_heads, head_dim) = qkv.shape[0], k_cache.shape
    q = torch.empty(num_tokens, num_heads, head_dim, dtype=qkv.dtype)
    kernels.rope_store_kv(qkv.data_ptr(), cos.data_ptr(), sin.data_ptr(), slot_mapping.data_ptr(),
                          q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), num_tokens,
                          num_heads, num_kv_heads, head_dim, int(qkv.dtype == torch.bfloat16),
                          torch.get_num_threads())
    return q


def silu_and_mul(gate_up: Tensor) -> Optional[Tensor]:
    """silu_and_mul.c: silu(gate) * up from the fused gate_up rows [tokens, 2 * intermediate]
    (gate first), as a new contiguous [tokens, intermediate] tensor. None where the kernel cannot
    run here; the caller then uses torch."""
    kernels = load()
    if kernels is None or not _takes(gate_up):
        return None
    out = gate_up.new_empty(gate_up.shape[0], gate_up.shape[1] // 2)
    kernels.silu_and_mul(gate_up.data_ptr(), out.data_ptr(), out.shape[0], out.shape[1],
                         int(gate_up.dtype == torch.bfloat16), torch.get_num_threads())
    return out


def argmax(x: Tensor) -> Tensor:
    """argmax.c: x.argmax(dim=-1) for a float32 or bf16 [rows, n] tensor, the same indices (first
    maximum; a NaN beats every number). Falls back to torch where the kernel cannot run."""
    kernels = load()
    if kernels is None or x.dim() != 2 or x.shape[1] == 0 or not _takes(x):
        return x.argmax(dim=-1)
    out = torch.empty(x.shape[0], dtype=torch.long)
    kernels.argmax(x.data_ptr(), out.data_ptr(), x.shape[0], x.shape[1], int(x.dtype == torch.bfloat16),
                   torch.get_num_threads())
    return out


def gemm_pack(weight: Tensor, bias: Optional[Tensor]) -> tuple[Tensor, Tensor]:
    """gemm.c's packing of a float32 or bf16 weight [out, in] into panels, with the bias (or
    zeros) in float32 padded to whole panels: what `gemm` multiplies by. RuntimeError where the
    kernels cannot run here (cpu/gemm.py then keeps another path)."""
    kernels, weight = load(), weight.contiguous()
    if kernels is None or weight.dim() != 2 or not _takes(weight):
        raise RuntimeError("the C GEMM needs the CPU kernels and a float32 or bf16 weight")
    (n, k), bf16, width = weight.shape, weight.dtype == torch.bfloat16, kernels.gemm_panel_width()
    columns = -(-n // width) * width
    packed = weight.new_empty(columns * (k + k % 2 if bf16 else k))
    kernels.gemm_pack(weight.data_ptr(), packed.data_ptr(), n, k, int(bf16))
    padded_bias = torch.zeros(columns)
    if bias is not None:
        padded_bias[:n] = bias.detach().float()
    return packed, padded_bias


def gemm_pack_int8(weight: Tensor, scale: Tensor, bias: Optional[Tensor],
                   pairs: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    """gemm_pack's layout for an int8 weight [out, in] (quantization.py), one byte an element:
    float32's, or with `pairs` (for bf16 x) bf16's k-pairs.
    gemm.c's gemm_int8 widens it in registers, or a panel at a time. Returns (packed, scales and
    bias in float32 padded to whole panels)."""
    if load() is None or weight.dtype != torch.int8:
        raise RuntimeError("the C int8 GEMM needs the CPU kernels and an int8 weight")
    width = load().gemm_panel_width()
    (n, k), panels = weight.shape, -(-weight.shape[0] // width)
    padded = weight.new_zeros(panels * width, k + k % 2 if pairs else k)
    padded[:n, :k] = weight
    scales, padded_bias = torch.zeros(panels * width), torch.zeros(panels * width)
    scales[:n] = scale.float()
    if bias is not None:
        padded_bias[:n] = bias.detach().float()
    # [panel][k][column], or [panel][k / 2][column][k % 2]
    packed = (padded.view(panels, width, -1, 2).permute(0, 2, 1, 3) if pairs else
              padded.view(panels, width, k).permute(0, 2, 1)).contiguous().flatten()
    return packed, scales, padded_bias


def _as_rows(x: Tensor) -> Tensor:
    """x [..., in] as contiguous rows [n, in]; the model's 2-D x as it is (reshape: ~0.8 us)."""
    return (x if x.dim() == 2 else x.reshape(-1, x.shape[-1])).contiguous()


def gemm(x: Tensor, packed: Tensor, bias: Tensor, out_features: int, scales: Optional[Tensor] = None,
         register_rows: int = 0) -> Tensor:
    """gemm.c: x [..., in] @ W.T + b, with W and b as `gemm_pack` packed them; in W's dtype (the
    model's rows already are).
    scales (W packed by gemm_pack_int8): gemm_int8's product, W = q x scales, in registers up to
    `register_rows` rows (x in the model's dtype, float32 or bf16)."""
    rows = _as_rows(x if scales is not None else x.to(packed.dtype))
    m, k = rows.shape
    out = rows.new_empty(m, out_features)
    args = (rows.data_ptr(), packed.data_ptr(), bias.data_ptr(), out.data_ptr(), m, out_features, k,
            int(rows.dtype == torch.bfloat16))
    if (load().gemm(*args, torch.get_num_threads()) if scales is None
            else load().gemm_int8(*args, scales.data_ptr(), register_rows, torch.get_num_threads())):
        raise MemoryError(f"gemm.c could not allocate its copies of x ({m} x {k})")
    return out if x.dim() == 2 else out.view(*x.shape[:-1], out_features)


def gemm_amx_ready() -> bool:
    """Whether gemm.c's AMX product can run here (built for a CPU with AMX, Linux granted it)."""
    kernels = load()
    return kernels is not None and bool(kernels.gemm_amx_ready())


def gemm_amx(x: Tensor, weight: Tensor, bias: Tensor) -> Optional[Tensor]:
    """gemm.c's AMX product: x [..., in] @ weight.T + bias, bf16, with weight as it is ([out, in],
    contiguous) and bias float32 [out]. None where it cannot run (in not a multiple of 32, out of
    memory)."""
    rows = _as_rows(x)
    (m, k), n = rows.shape, weight.shape[0]
    out = rows.new_empty(m, n)
    if load().gemm_amx(rows.data_ptr(), weight.data_ptr(), bias.data_ptr(), out.data_ptr(), m, n, k,
                       torch.get_num_threads()):
        return None
    return out if x.dim() == 2 else out.view(*x.shape[:-1], n)


def moe_amx(hidden: Tensor, weights: Tensor, ids: Tensor, local_of: Tensor, w13: Tensor, w2: Tensor,
            zeros: Tensor, out: Tensor) -> None:
    """gemm.c's moe_amx: out = FusedMoE.forward_native(hidden) for the router's (weights, ids)
    [tokens, top_k], in one call: local_of maps a global expert id to the index of its weights in
    w13 [experts, 2 x inter, hidden] and w2 [experts, hidden, inter] (bf16, contiguous), or to
    `experts` where none is held here. zeros: float32 [max(2 x inter, hidden)]."""
    (tokens, top_k), (experts, hidden_size, inter) = ids.shape, w2.shape
    ids, weights = ids.to(torch.int64).contiguous(), weights.to(torch.float32).contiguous()
    if load().moe_amx(_as_rows(hidden).data_ptr(), ids.data_ptr(), weights.data_ptr(), local_of.data_ptr(),
                      tokens, top_k, experts, w13.data_ptr(), w2.data_ptr(), zeros.data_ptr(),
                      out.data_ptr(), hidden_size, inter, torch.get_num_threads()):
        raise MemoryError(f"gemm.c's moe_amx could not allocate its buffers ({tokens} tokens)")
