"""The CUDA path's decisions, checked on a machine without a GPU:

  - resolve_dtype: vLLM's 'auto' rule on GPUs with and without bf16 (gpu_info replaced by a fake);
  - resolve_device: 'cuda' where torch has none is a ValueError that says why, up to LLM();
  - cuda_device_for_rank: which GPU each tensor-parallel rank takes, and too few GPUs;
  - the memory profile that sizes the KV pool, on CPU with a stub for the device's figures: its
    step within the model's positions, the budget from the device's used memory, the cap;
  - the Triton kernels compile for real GPUs (sm_90 in bf16 and float32, sm_75 in float16) down
    to a cubin (ptxas), with the constexprs and warps their launchers pick, for every launch
    cuda/backend.compile_kernels makes: RoPE + store, unified and split-K attention (the
    interpreter cannot see what only the compiler rejects; test_triton_ops.py: the row kernels);
    and the fused MoE's grouped GEMM at Qwen3-30B-A3B's layer, 16-bit dots on the tensor cores.

    pytest -q tests/test_gpu_path.py

scripts/gpu_smoke.py runs what only a GPU can show (the kernels' numbers, LLM on CUDA == CPU).
"""

import contextlib
import functools
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from nanoserve import distributed, model_loader, model_runner
from nanoserve.config import Config
from nanoserve.distributed import cuda_device_for_rank
from nanoserve.model_loader import (DeviceMemory, GpuInfo, max_useful_kv_blocks, resolve_device,
                                    resolve_dtype)

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


# ------------------------------------------------ the memory profile, on CPU with a stub device
MiB = 2**20
# nanoserve-tiny in float32 (the CPU's dtype): 2 x 4 layers x 2 kv_heads x 32 x 4 B x 16 tokens
BLOCK_BYTES = 32 * 1024


def stub_memory(total, free, peak=136 * MiB, current=100 * MiB) -> DeviceMemory:
    """A device as torch.cuda would report it: `total - free` held (weights, context, other
    processes), and a profile whose peak rose `peak - current` above what stays allocated."""
    return DeviceMemory(mem_get_info=lambda device: (free, total),
                        memory_allocated=lambda device: current,
                        max_memory_allocated=lambda device: peak,
                        reset_peak_memory_stats=lambda device: None, empty_cache=lambda: None,
                        synchronize=lambda device: None)


@pytest.fixture(scope="module")
def profiled():
    """nanoserve-tiny at Config()'s defaults (512 positions, a 2048-token budget), its pool
    sized by the profile: 1000 MiB x 0.9 - 800 MiB held - 36 MiB of activations = 64 MiB."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(model_runner, "device_memory", lambda d: stub_memory(1000 * MiB, 200 * MiB))
        return model_runner.ModelRunner(Config())


def test_profile_runs_the_biggest_step_within_the_models_positions(profiled, monkeypatch):
    # One sequence of 2048 tokens would index the 512-row RoPE tables past their end.
    assert profiled.config.num_kv_blocks == 64 * MiB // BLOCK_BYTES
    steps, real = [], profiled.prepare_inputs
    monkeypatch.setattr(profiled, "prepare_inputs", lambda out: steps.append(out) or real(out))
    monkeypatch.setattr(model_runner, "device_memory", lambda d: stub_memory(1000 * MiB, 200 * MiB))
    profiled._num_kv_blocks(Config())
    profiled._num_kv_blocks(Config(max_model_len=300))
    profiled._num_kv_blocks(Config(max_model_len=300, max_num_seqs=4))   # never more than it runs
    assert [s.num_scheduled_tokens for s in steps] == [[512] * 4, [300] * 6 + [248], [300] * 4]


def test_budget_counts_what_the_device_holds(profiled, monkeypatch):
    def blocks(free, **config):
        monkeypatch.setattr(model_runner, "device_memory", lambda d: stub_memory(1000 * MiB, free))
        return profiled._num_kv_blocks(Config(**config))
    assert blocks(200 * MiB) == 64 * MiB // BLOCK_BYTES
    # 32 MiB more held (another process, the CUDA context): 32 MiB less for the pool.
    assert blocks(168 * MiB) == 32 * MiB // BLOCK_BYTES
    with pytest.raises(ValueError, match=r"no GPU memory left.*utilization 0.5.*in use 0.78 GiB"):
        blocks(200 * MiB, gpu_memory_utilization=0.5)


def test_pool_from_a_huge_gpu_is_capped_as_the_calculator_caps_it(profiled, monkeypatch):
    from nanoserve.tools.memory import memory_report
    monkeypatch.setattr(model_runner, "device_memory", lambda d: stub_memory(141e9, 140e9))
    cap = max_useful_kv_blocks(64, 512, 16)        # x 2 of 64 sequences of 32 blocks
    assert cap == 4096 and profiled._num_kv_blocks(Config()) == cap
    assert profiled._num_kv_blocks(Config(max_model_len=256, max_num_seqs=8)) == 2 * 8 * 16
    assert profiled._num_kv_blocks(Config(num_kv_blocks=100_000)) == 100_000   # given: as is
    assert memory_report(device_memory_gb=141).num_blocks == cap
    assert memory_report(device_memory_gb=141, max_model_len=256, max_num_seqs=8).num_blocks == 256


# -------------------------------------------------------------------------- the kernels compile

TRITON_TYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16",
                torch.int32: "i32", torch.int64: "i64", torch.float8_e4m3fn: "fp8e4nv", torch.int8: "i8"}


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


@contextlib.contextmanager
def record_launches(*modules):
    """Within it, each Triton kernel (`_*_kernel`) of `modules` records its launches, (kernel,
    args, kwargs), instead of running; they are back on leaving (a compile reads them)."""
    launches, saved = [], {}

    class Recorder:
        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid):
            return lambda *args, **kwargs: launches.append((self.kernel, args, kwargs))
    for module in modules:
        for name in [n for n in vars(module) if n.startswith("_") and n.endswith("_kernel")]:
            saved[module, name] = getattr(module, name)
            setattr(module, name, Recorder(saved[module, name]))
    try:
        yield launches
    finally:
        for (module, name), kernel in saved.items():
            setattr(module, name, kernel)


def compile_every_launch() -> None:
    """For each case, record the launches compile_kernels makes (instead of running them) and
    compile each for that GPU. Needs TRITON_INTERPRET=0 from the start of its process."""
    from nanoserve.cuda import backend, decode_attention_triton, norm_rope_triton
    from nanoserve.cuda import paged_attention_triton as pat
    for capability, dtype, num_heads, num_kv_heads, head_dim in COMPILE_CASES:
        with record_launches(pat, decode_attention_triton, norm_rope_triton) as launches:
            backend.compile_kernels(num_heads, num_kv_heads, head_dim, 16, dtype, torch.device("cpu"))
        assert {k.fn.__name__ for k, *_ in launches} == {
            "_rope_store_kv_kernel", "_unified_attention_kernel", "_split_kv_decode_kernel",
            "_reduce_segments_kernel"}
        # The block-table widths differ only in a value, which this signature does not specialise on.
        distinct = {(k.fn.__name__, tuple(sorted(kw.items()))): (k, a, kw) for k, a, kw in launches}
        for kernel, args, kwargs in distinct.values():
            assert compile_launch(kernel, args, kwargs, capability).asm["cubin"]
        print(f"sm_{capability} {dtype}: {len(distinct)} kernels compiled")


def compile_row_kernels() -> None:
    """The row kernels (norm_rope_triton.py, activation_triton.py) launched at SmolLM2-135M's
    shapes in bf16 (and Qwen3's per-head norm on qkv views), each compiled for sm_90 to a cubin.
    Needs TRITON_INTERPRET=0 from the start of its process."""
    from nanoserve.cuda import activation_triton as act
    from nanoserve.cuda import norm_rope_triton as nr
    zeros = functools.partial(torch.zeros, dtype=torch.bfloat16)
    with record_launches(nr, act) as launches:
        hidden, qkv = zeros(2, 576), zeros(2, 9 + 2 * 3, 64)
        nr.rms_norm_triton(hidden[0], 1e-5, hidden)
        nr.rms_norm_triton(hidden[0], 1e-5, hidden, hidden.clone())
        nr.rms_norm_triton(qkv[0, 0], 1e-6, qkv[:, :9])
        act.silu_and_mul_triton(zeros(2, 2 * 1536))
        act.per_token_quant_fp8_triton(zeros(2, 1536))
    assert len(launches) == 5
    for kernel, args, kwargs in launches:
        compiled = compile_launch(kernel, args, kwargs, 90)
        assert compiled.asm["cubin"], kernel.fn.__name__
        # x / scale rounded as torch rounds it (IEEE division), not div.full's approximation.
        assert kernel.fn.__name__ != "_per_token_quant_fp8_kernel" or "div.rn.f32" in compiled.asm["ptx"]
    print(f"sm_90: {len(launches)} row kernels compiled")


def compile_fused_moe() -> None:
    """fused_moe_triton's launches at Qwen3-30B-A3B's layer (hidden 2048, moe_intermediate 768,
    top-8; 8 of its 128 experts, since their number is no argument the kernel specialises on), at
    1 and 64 tokens (moe_config's two tiles), in bf16 with bf16, int8 and fp8 weights and in
    float32: each distinct launch compiled for sm_90 to a cubin. Needs TRITON_INTERPRET=0 from the
    start of its process."""
    from nanoserve.cuda import activation_triton as act
    from nanoserve.cuda import fused_moe_triton as moe
    from nanoserve.layers import FusedMoE
    with record_launches(moe, act) as launches:
        for dtype, quantization in ((torch.bfloat16, None), (torch.bfloat16, "int8"),
                                    (torch.bfloat16, "fp8"), (torch.float32, None)):
            op = FusedMoE(8, 8, 2048, 768, renormalize=True, quantization=quantization)
            op = op if quantization else op.to(dtype)
            for tokens in (1, 64):
                moe.fused_moe_triton(op, moe.expert_map(op), torch.zeros(tokens, 2048, dtype=dtype),
                                     torch.zeros(tokens, 8, dtype=dtype))
    distinct = {(k.fn.__name__, tuple(sorted(kw.items())), tuple(str(a.dtype) for a in args
                                                               if isinstance(a, torch.Tensor))): (k, args, kw)
                for k, args, kw in launches}
    assert len(distinct) == 4 * 2 * 2 + 2     # each case's two GEMMs at two tiles, silu·mul twice
    for kernel, args, kwargs in distinct.values():
        compiled = compile_launch(kernel, args, kwargs, 90)
        assert compiled.asm["cubin"], kernel.fn.__name__
        if kernel.fn.__name__ == "_fused_moe_kernel":   # "ieee" keeps float32 off TF32, not bf16 off the MMA
            assert ("mma" in compiled.asm["ptx"]) == (args[0].dtype == torch.bfloat16)
    print(f"sm_90: {len(distinct)} fused MoE launches compiled")


@pytest.mark.parametrize("compile_all", ["compile_every_launch", "compile_row_kernels", "compile_fused_moe"])
def test_kernels_compile_for_gpus(compile_all):
    # In a fresh process: once the interpreter has run in a process (test_paged_attention_triton.py),
    # triton.language stays patched for it there and compiling fails.
    pytest.importorskip("triton")
    child = subprocess.run([sys.executable, "-c", f"import {__name__} as t; t.{compile_all}()"],
                           cwd=os.path.dirname(__file__), env={**os.environ, "TRITON_INTERPRET": "0"},
                           capture_output=True, text=True, timeout=600)
    assert child.returncode == 0, child.stderr[-4000:]


NO_CPU_BACKEND_ON_CUDA = r"""
import sys, torch
from transformers import LlamaConfig
import nanoserve.cuda.backend as cuda_backend
from nanoserve.backends import load_backend
from nanoserve.config import Config
from nanoserve.models.llama import LlamaForCausalLM

cuda_backend.bind = lambda model, block_size, gemm_paths: "the CUDA backend"  # no GPU to bind here
model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                     num_hidden_layers=1, num_attention_heads=2))
assert load_backend(model, Config(), torch.device("cuda")) == "the CUDA backend"
print(sorted(m for m in sys.modules if m.startswith("nanoserve.cpu")))
"""


def test_a_cuda_device_never_builds_the_cpu_kernels():
    """On CUDA the registry takes the CUDA backend alone: nothing of nanoserve/cpu/ is imported,
    so no rank runs gcc at start-up or warns about slower torch paths (a fresh process: this
    one has imported the CPU backend already)."""
    run = subprocess.run([sys.executable, "-c", NO_CPU_BACKEND_ON_CUDA], capture_output=True,
                         text=True, check=True)
    assert run.stdout.strip() == "[]"
