"""host_memory.py: two requests to Linux for the CPU backend's memory (glibc's allocator, huge
pages), made once at load. Both are speed only: where they do not apply (not Linux, not glibc,
THP off) nothing changes but the speed. The figures behind them, with the CPU each was measured
on: scripts/results/README.md.
"""

from __future__ import annotations

import ctypes
import sys
from typing import Optional

import torch


def _libc() -> Optional[ctypes.CDLL]:
    """glibc on Linux, else None (macOS, Windows, musl: the tuning below is skipped)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None


def keep_freed_memory() -> None:
    """Ask glibc to keep freed activation memory for reuse instead of unmapping it.

    Why: a 2048-token prefill allocates and frees activations of up to ~25 MB in every layer. By
    default glibc serves big blocks with fresh mmap()s and gives them back on free(), so each such
    step pays hundreds of thousands of page faults. With the mmap threshold at glibc's 32 MiB
    maximum and trimming only above 1 GiB, memory is reused."""
    libc = _libc()
    if libc is None:
        return
    m_trim_threshold, m_mmap_threshold = -1, -3  # from glibc's malloc.h
    libc.mallopt(m_mmap_threshold, 32 * 2**20)
    libc.mallopt(m_trim_threshold, 2**30)


def advise_huge_pages(tensor: torch.Tensor) -> None:
    """Ask Linux to back a big CPU tensor with 2 MiB pages (transparent huge pages), before its
    memory is first touched.

    Why, for the KV cache: a decode token's attention reads its request's blocks, which lie
    anywhere in a cache of gigabytes. With 4 KiB pages nearly every block costs TLB misses (the TLB
    covers a few MiB); with 2 MiB pages far fewer. Where THP is off ("never") this does nothing;
    where it is "always", the kernel already does it."""
    libc = _libc()
    if libc is None:
        return
    huge, madv_hugepage = 2 * 2**20, 14    # the page size; MADV_HUGEPAGE from <sys/mman.h>
    start = tensor.data_ptr()
    end = start + tensor.numel() * tensor.element_size()
    first, last = -(-start // huge) * huge, end // huge * huge   # whole huge pages inside
    if last > first:
        libc.madvise(ctypes.c_void_p(first), ctypes.c_size_t(last - first), madv_hugepage)


def new_kv_cache(shape: tuple, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """One layer's zeroed K or V cache, on huge pages where Linux grants them."""
    cache = torch.empty(shape, dtype=dtype, device=device)
    advise_huge_pages(cache)   # before zero_() touches (and so maps) its pages
    return cache.zero_()
