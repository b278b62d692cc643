"""paged_attention_cpu.py: the CPU decode-attention kernel (csrc/decode_attention.c): build, load, call.

Why a C kernel on CPU: decode attention is memory-bound. The torch path (paged_attention.py)
gathers each request's blocks into a contiguous copy for SDPA, so the cache is read, the copy
written, and the copy read again; the kernel follows the block table in place and reads K/V once.
On the bench model (nanoserve bench, float32, 2 cores), a 64-request decode step spends 196 of its
305 ms in torch attention; with the kernel, 45 of 158 ms (about 22 GB/s of K/V read, near this
machine's ~24 GB/s memory bandwidth).

The kernel is compiled on first use with the system C compiler (`$CC`, else `cc`), with
-march=native for this machine's vector units and OpenMP for its cores, into a cache directory
keyed by the source, the flags and the CPU; later processes just load it. Without a compiler, or
on a platform where the build fails, `load()` returns None and attention stays on the torch path
(one warning).
NANOSERVE_CPU_KERNEL=0 in the environment keeps it off (to compare the two paths).

    from nanoserve.paged_attention_cpu import load
    kernel = load()          # ctypes function, or None

Test: pytest -q tests/test_paged_attention.py   (the kernel against the torch reference)
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

import torch
from torch import Tensor

SOURCE = Path(__file__).parent / "csrc" / "decode_attention.c"
FLAGS = ["-O3", "-march=native", "-fopenmp", "-fPIC", "-Werror",
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
    """The compiled kernel as a ctypes function, or None when it cannot be built here."""
    if not sys.platform.startswith("linux") or os.environ.get("NANOSERVE_CPU_KERNEL") == "0":
        return None
    source = SOURCE.read_bytes()
    compiler = os.environ.get("CC", "cc")
    # -march=native code is only good on this kind of CPU: a home directory shared between
    # machines must not hand one machine's build to another, so the CPU's flags are in the key.
    key = hashlib.sha256(source + " ".join([compiler] + FLAGS + LINK_FLAGS).encode()
                         + _cpu_flags()).hexdigest()[:16]
    library = cache_dir() / f"decode_attention-{key}.so"
    try:
        if not library.is_file():
            library.parent.mkdir(parents=True, exist_ok=True)
            # Build beside the target and rename: concurrent first runs never load half a file.
            with tempfile.TemporaryDirectory(dir=library.parent) as tmp:
                built, obj = Path(tmp) / library.name, Path(tmp) / "decode_attention.o"
                for command in ([compiler, *FLAGS, "-c", str(SOURCE), "-o", str(obj)],
                                [compiler, *LINK_FLAGS, str(obj), "-o", str(built), "-lm"]):
                    subprocess.run(command, check=True, capture_output=True, text=True)
                os.replace(built, library)
        fn = ctypes.CDLL(str(library)).decode_attention
    except (OSError, subprocess.CalledProcessError) as e:
        detail = getattr(e, "stderr", None) or e
        warnings.warn(f"nanoserve: the CPU decode-attention kernel could not be built ({detail}); "
                      f"using the slower torch path")
        return None
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p] * 7 + [ctypes.c_int] * 6 + [ctypes.c_float] + [ctypes.c_int] * 2
    return fn


def decode_attention_cpu(query: Tensor, out: Tensor, k_cache: Tensor, v_cache: Tensor,
                         token_index: Tensor, block_tables: Tensor, seq_lens: Tensor,
                         scale: float) -> bool:
    """out[t] = attention of query[t] over its request's first seq_len cached tokens, for each
    decode token t in `token_index`, with that request's `block_tables` row and `seq_lens` in the
    same order: contiguous int32, as `AttentionMetadata.decodes` makes them once per step. Returns
    False when the kernel is unavailable, the shapes are outside what it supports, or it ran out
    of memory; the caller then uses the torch path."""
    kernel = load()
    if (kernel is None or query.device.type != "cpu" or query.dtype not in (torch.float32, torch.bfloat16)
            or k_cache.dtype != query.dtype or not (query.is_contiguous() and k_cache.is_contiguous()
                                                   and v_cache.is_contiguous() and out.is_contiguous())):
        return False
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    status = kernel(query.data_ptr(), out.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
                    token_index.data_ptr(), block_tables.data_ptr(), seq_lens.data_ptr(),
                    token_index.shape[0], block_tables.shape[1], block_size, num_kv_heads,
                    query.shape[1] // num_kv_heads, head_dim, scale,
                    int(query.dtype == torch.bfloat16), torch.get_num_threads())
    return status == 0
