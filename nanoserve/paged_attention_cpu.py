"""paged_attention_cpu.py: the CPU attention kernels (csrc/): build, load, call.

Two kernels, both reading K/V in place through the block tables (the torch path in
paged_attention.py first gathers each request's blocks into a contiguous copy for SDPA):
    decode_attention.c   decode tokens (one new token per request): memory-bound, so reading the
                         cache once is the point. On the bench model (float32, 2 cores, Zen 3) a
                         64-request decode step spent 196 of its 305 ms in torch attention; with
                         the kernel, 45 of 158 ms.
    prefill_attention.c  every other request (prefill, chunked prefill, prefix hit): compute-bound,
                         a flash-attention loop with the query tokens in the vector lanes.

The kernels are compiled on first use with the system C compiler (`$CC`, else `cc`), with
-march=native for this machine's vector units and OpenMP for its cores, into a cache directory
keyed by the source, the flags and the CPU; later processes just load it. Without a compiler, or
on a platform where the build fails, `load()` returns None and attention stays on the torch path
(one warning).
NANOSERVE_CPU_KERNEL=0 in the environment keeps them off (to compare the two paths).

    from nanoserve.paged_attention_cpu import load
    kernels = load()         # the ctypes library (kernels.decode_attention, .prefill_attention), or None

Test: pytest -q tests/test_paged_attention.py   (the kernels against the torch reference)
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

CSRC = Path(__file__).parent / "csrc"
SOURCES = [CSRC / "decode_attention.c", CSRC / "prefill_attention.c"]
HEADER = CSRC / "cpu_attention.h"
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
    """The compiled kernels as a ctypes library, or None when they cannot be built here."""
    if not sys.platform.startswith("linux") or os.environ.get("NANOSERVE_CPU_KERNEL") == "0":
        return None
    source = b"".join(path.read_bytes() for path in [HEADER, *SOURCES])
    compiler = os.environ.get("CC", "cc")
    # -march=native code is only good on this kind of CPU: a home directory shared between
    # machines must not hand one machine's build to another, so the CPU's flags are in the key.
    key = hashlib.sha256(source + " ".join([compiler] + FLAGS + LINK_FLAGS).encode()
                         + _cpu_flags()).hexdigest()[:16]
    library = cache_dir() / f"cpu_attention-{key}.so"
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
        warnings.warn(f"nanoserve: the CPU attention kernels could not be built ({detail}); "
                      f"using the slower torch path")
        return None
    # Both take: query, out, k_cache, v_cache, then their int32 arrays, then the sizes, scale,
    # bf16 and the thread count.
    for fn, arrays, sizes in ((kernels.decode_attention, 3, 6), (kernels.prefill_attention, 4, 6)):
        fn.restype = ctypes.c_int
        fn.argtypes = ([ctypes.c_void_p] * (4 + arrays) + [ctypes.c_int] * sizes + [ctypes.c_float]
                       + [ctypes.c_int] * 2)
    return kernels


def attention_kernel(name: str, query: Tensor, out: Tensor, k_cache: Tensor, v_cache: Tensor,
                     requests, scale: float) -> bool:
    """Run kernel `name` ("decode_attention" or "prefill_attention") for `requests` (a
    paged_attention.RequestGroup: contiguous int32 tensors) into `out`. Returns False when the
    kernels are unavailable, the tensors are outside what they support, or a kernel ran out of
    memory; the caller then uses the torch path for those requests."""
    kernels = load()
    if (kernels is None or query.device.type != "cpu" or query.dtype not in (torch.float32, torch.bfloat16)
            or k_cache.dtype != query.dtype or not (query.is_contiguous() and k_cache.is_contiguous()
                                                   and v_cache.is_contiguous() and out.is_contiguous())):
        return False
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    # A decode's one token is at its query_start; the prefill kernel also needs the lengths.
    arrays = [requests.query_start, requests.block_tables, requests.seq_lens]
    if name == "prefill_attention":
        arrays.insert(1, requests.query_len)
    status = getattr(kernels, name)(
        query.data_ptr(), out.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
        *(a.data_ptr() for a in arrays), len(requests.indices), requests.block_tables.shape[1],
        block_size, num_kv_heads, query.shape[1] // num_kv_heads, head_dim, scale,
        int(query.dtype == torch.bfloat16), torch.get_num_threads())
    return status == 0
