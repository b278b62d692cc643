"""The CUDA path's decisions, checked on a machine without a GPU:

  - resolve_dtype: vLLM's 'auto' rule on GPUs with and without bf16 (gpu_info replaced by a fake);
  - resolve_device: 'cuda' where torch has none is a ValueError that says why, up to LLM();
  - cuda_device_for_rank: which GPU each tensor-parallel rank takes, and too few GPUs;
  - the Triton kernels compile for real GPUs (sm_90 in bf16 and float32, sm_75 in float16), with
    the constexprs and warps paged_attention_triton picks, for every launch compile_kernels makes
    (the interpreter cannot see what only the compiler rejects).

    pytest -q tests/test_gpu_path.py

scripts/gpu_smoke.py runs what only a GPU can show (the kernels' numbers, LLM on CUDA == CPU).
"""

import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from nanoserve import distributed, model_loader
from nanoserve.distributed import cuda_device_for_rank
from nanoserve.model_loader import GpuInfo, resolve_device, resolve_dtype

CUDA = torch.device("cuda")
H100 = GpuInfo("NVIDIA H100", (9, 0), True)
T4 = GpuInfo("Tesla T4", (7, 5), False)
V100 = GpuInfo("Tesla V100", (7, 0), True)  # torch may say yes (emulation); before sm_80 it is no


def checkpoint(dtype):
    return SimpleNamespace(torch_dtype=dtype)


@pytest.mark.parametrize("gpu, saved, expected", [
    (H100, "float32", torch.bfloat16), (H100, torch.bfloat16, torch.bfloat16),
    (H100, "float16", torch.float16), (H100, None, torch.bfloat16),
    (T4, "float32", torch.float16), (T4, "bfloat16", torch.float16),
    (V100, "float32", torch.float16), (V100, torch.bfloat16, torch.float16),
    (None, "float32", torch.bfloat16),  # no GPU here (nanoserve memory sizing one): a current GPU
])
def test_auto_dtype_on_cuda(monkeypatch, gpu, saved, expected):
    monkeypatch.setattr(model_loader, "gpu_info", lambda device: gpu)
    assert resolve_dtype("auto", CUDA, checkpoint(saved)) == expected


def test_explicit_dtype_and_cpu(monkeypatch):
    monkeypatch.setattr(model_loader, "gpu_info", lambda device: T4)
    assert resolve_dtype("float32", CUDA, checkpoint("bfloat16")) == torch.float32
    assert resolve_dtype("float16", CUDA, checkpoint("float32")) == torch.float16
    with pytest.raises(ValueError, match=r"dtype 'bfloat16'.*Tesla T4.*7\.5"):
        resolve_dtype("bfloat16", CUDA, checkpoint("float32"))
    cpu = torch.device("cpu")
    assert resolve_dtype("auto", cpu, checkpoint("bfloat16")) == torch.float32
    assert resolve_dtype("bfloat16", cpu, checkpoint("float32")) == torch.bfloat16


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message where torch has no CUDA")
def test_cuda_without_cuda_says_why(monkeypatch):
    from nanoserve import LLM
    assert resolve_device("auto") == "cpu"
    build = "CPU build" if torch.version.cuda is None else "finds no GPU"
    with pytest.raises(ValueError, match=f"device 'cuda'.*is_available.*False.*{build}"):
        LLM(device="cuda")
    monkeypatch.setattr(torch.version, "cuda", "12.4")
    with pytest.raises(ValueError, match="built for CUDA/ROCm 12.4 finds no GPU"):
        resolve_device("cuda")


def test_cuda_device_for_rank():
    assert [cuda_device_for_rank(r, 4, 8) for r in range(4)] == [0, 1, 2, 3]
    assert cuda_device_for_rank(5, 8, 4, local_rank=1) == 1  # rank 5 of 2 hosts x 4 GPUs
    with pytest.raises(ValueError, match="tensor_parallel_size 4 needs 4 GPUs.*sees 2"):
        cuda_device_for_rank(0, 4, 2)
    with pytest.raises(ValueError, match="tensor_parallel_size 8 needs 5 GPUs.*sees 4"):
        cuda_device_for_rank(4, 8, 4, local_rank=4)
    with pytest.raises(ValueError, match="rank 2 is outside tensor_parallel_size 2"):
        cuda_device_for_rank(2, 2, 8)


def test_local_rank_only_from_a_launcher_of_this_rank(monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setenv("RANK", "7")
    assert distributed._launcher_local_rank(7) == 3
    # nanoserve's own workers inherit their parent's LOCAL_RANK: not theirs.
    assert distributed._launcher_local_rank(1) is None
    monkeypatch.delenv("RANK")
    assert distributed._launcher_local_rank(7) is None


# -------------------------------------------------------------------------- the kernels compile

TRITON_TYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16",
                torch.int32: "i32", torch.int64: "i64"}


def compile_launch(kernel, args, kwargs, capability):
    """triton.compile for one recorded launch: the signature from the argument values."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    values = dict(zip(kernel.arg_names, args), **kwargs)
    signature, constexprs = {}, {}
    for i, name in enumerate(kernel.arg_names):
        value = values[name]
        if i in kernel.constexprs:
            signature[name], constexprs[(i,)] = "constexpr", value
        elif isinstance(value, torch.Tensor):
            signature[name] = "*" + TRITON_TYPES[value.dtype]
        else:
            signature[name] = "fp32" if isinstance(value, float) else "i32"
    source = ASTSource(kernel, signature, constexprs=constexprs)
    return triton.compile(source, target=GPUTarget("cuda", capability, 32),
                          options={"num_warps": kwargs["num_warps"]})


COMPILE_CASES = [  # (compute capability, dtype, num_heads, num_kv_heads, head_dim)
    (90, torch.bfloat16, 32, 8, 128),  # Llama-3-8B on an H100/H200: 'auto' picks bf16
    (90, torch.float32, 6, 2, 32),     # nanoserve-tiny in float32, as scripts/gpu_smoke.py runs it
    (75, torch.float16, 32, 32, 80),   # Phi-2 on a T4: 'auto' picks float16
]


def compile_every_launch() -> None:
    """For each case, record the launches compile_kernels makes (instead of running them) and
    compile each for that GPU. Needs TRITON_INTERPRET=0 from the start of its process."""
    from nanoserve.cuda import paged_attention_triton as pat
    launches = []

    class Recorder:
        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid):
            return lambda *args, **kwargs: launches.append((self.kernel, args, kwargs))
    for name in ("_store_kv_kernel", "_unified_attention_kernel"):
        setattr(pat, name, Recorder(getattr(pat, name)))
    for capability, dtype, num_heads, num_kv_heads, head_dim in COMPILE_CASES:
        launches.clear()
        pat.compile_kernels(num_heads, num_kv_heads, head_dim, 16, dtype, torch.device("cpu"))
        assert {k.fn.__name__ for k, *_ in launches} == {"_store_kv_kernel", "_unified_attention_kernel"}
        # The block-table widths differ only in a value, which this signature does not specialise on.
        distinct = {(k.fn.__name__, tuple(sorted(kw.items()))): (k, a, kw) for k, a, kw in launches}
        for kernel, args, kwargs in distinct.values():
            assert compile_launch(kernel, args, kwargs, capability).asm["cubin"]
        print(f"sm_{capability} {dtype}: {len(distinct)} kernels compiled")


def test_kernels_compile_for_gpus():
    # In a fresh process: once the interpreter has run in a process (test_paged_attention_triton.py),
    # triton.language stays patched for it there and compiling fails.
    pytest.importorskip("triton")
    child = subprocess.run([sys.executable, "-c", f"import {__name__} as t; t.compile_every_launch()"],
                           cwd=os.path.dirname(__file__), env={**os.environ, "TRITON_INTERPRET": "0"},
                           capture_output=True, text=True, timeout=600)
    assert child.returncode == 0, child.stderr[-4000:]
