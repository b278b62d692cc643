"""The Triton modules in this process's TRITON_INTERPRET mode, for the tests that run the kernels.

triton.jit picks the interpreter or the compiler when a module is imported; if another test
imported the kernels first in the other mode, they are imported again here, the backend last (it
binds their functions). Set TRITON_INTERPRET before importing this.
"""

import importlib
import os

from triton.runtime.interpreter import InterpretedFunction

import nanoserve.cuda.activation_triton as act
import nanoserve.cuda.backend as cuda_backend
import nanoserve.cuda.decode_attention_triton as dat
import nanoserve.cuda.fused_moe_triton as moe
import nanoserve.cuda.norm_rope_triton as nr
import nanoserve.cuda.paged_attention_triton as pat

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def triton_modules():
    """(paged_attention_triton, decode_attention_triton, norm_rope_triton, activation_triton,
    fused_moe_triton, cuda.backend), each in this process's mode."""
    global pat, dat, nr, act, moe, cuda_backend
    if isinstance(pat._store_kv_kernel, InterpretedFunction) != INTERPRET:
        pat, dat, nr, act = (importlib.reload(m) for m in (pat, dat, nr, act))
        moe = importlib.reload(moe)   # after activation_triton, whose silu·mul it imports
        cuda_backend = importlib.reload(cuda_backend)
    return pat, dat, nr, act, moe, cuda_backend
