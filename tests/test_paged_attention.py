"""Oracle tests for paged attention: store_kv + paged attention == dense causal SDPA, for the torch
reference (paged_attention.py: store_kv_torch, paged_attention_torch) and the CPU backend's form
(cpu/ops.py: paged_attention_cpu, on the C kernels, and on the torch loop where they cannot run).

Each case is a random mixed batch (prefills, chunked prefills with a cached prefix, decodes, GQA)
on random, non-contiguous block tables. The reference never sees the cache: it runs
`scaled_dot_product_attention(is_causal=True)` over each request's whole sequence and keeps the
rows of this step's tokens.

    pytest -q tests/test_paged_attention.py
"""

import functools
import os
import shutil
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from nanoserve.attention_metadata import AttentionMetadata
from nanoserve.cpu import kernels as cpu_kernels
from nanoserve.cpu import ops as cpu_ops
from nanoserve.cpu.ops import paged_attention_cpu
from nanoserve.paged_attention import paged_attention_torch, store_kv_torch


def _build_step(requests, block_size, num_kv_heads, num_q_heads, head_dim, dtype, gen):
    """Random K/V/Q for each request's full sequence; the prefix already stored, this step's
    tokens flattened into one batch. `requests` is a list of (num_computed_tokens, query_len)."""
    blocks_needed = [-(-(nc + ql) // block_size) for nc, ql in requests]
    num_blocks = sum(blocks_needed) + 3  # spare blocks the tables never reach
    perm = torch.randperm(num_blocks, generator=gen).tolist()  # scattered, out-of-order blocks
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)

    max_blocks = max(blocks_needed)
    block_tables = torch.zeros(len(requests), max_blocks, dtype=torch.int32)
    seqs, step_q, step_k, step_v, slots, qsl = [], [], [], [], [], [0]
    for i, ((nc, ql), nb) in enumerate(zip(requests, blocks_needed)):
        table, perm = perm[:nb], perm[nb:]
        block_tables[i, :nb] = torch.tensor(table)
        seq_len = nc + ql
        q, k, v = (torch.randn(seq_len, h, head_dim, generator=gen).to(dtype)
                   for h in (num_q_heads, num_kv_heads, num_kv_heads))
        seqs.append((q, k, v, ql))
        pos = torch.arange(seq_len)
        seq_slots = torch.tensor(table)[pos // block_size] * block_size + pos % block_size
        store_kv_torch(k[:nc], v[:nc], k_cache, v_cache, seq_slots[:nc])  # earlier steps' prefix
        step_q.append(q[nc:]), step_k.append(k[nc:]), step_v.append(v[nc:])
        slots.append(seq_slots[nc:])
        qsl.append(qsl[-1] + ql)

    md = AttentionMetadata(
        slot_mapping=torch.cat(slots),
        block_tables=block_tables,
        seq_lens=torch.tensor([nc + ql for nc, ql in requests], dtype=torch.int32),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        max_query_len=max(ql for _, ql in requests),
    )
    return torch.cat(step_q), torch.cat(step_k), torch.cat(step_v), k_cache, v_cache, md, seqs


def _dense_reference(seqs, scale):
    outs = []
    for q, k, v, ql in seqs:
        group = q.shape[1] // k.shape[1]
        k, v = (x.repeat_interleave(group, dim=1) for x in (k, v))  # GQA by copying kv heads
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1).float(), k.transpose(0, 1).float(), v.transpose(0, 1).float(),
            is_causal=True, scale=scale,
        )
        outs.append(out.transpose(0, 1)[-ql:])
    return torch.cat(outs)


CASES = [
    # (num_computed_tokens, query_len) per request
    pytest.param([(0, 7)], id="single-prefill"),
    pytest.param([(5, 1), (12, 1), (0, 1), (31, 1)], id="decodes-only"),
    pytest.param([(9, 1), (0, 6), (4, 5), (17, 1), (8, 8), (2, 1)], id="mixed"),
    pytest.param([(16, 3), (3, 13), (0, 16)], id="chunked-prefill-block-aligned"),
]


# The reference, and the CPU form (the C kernels where this machine builds them, else the loop).
ATTENTION = [pytest.param(paged_attention_torch, id="torch"), pytest.param(paged_attention_cpu, id="cpu")]


@pytest.mark.parametrize("attention", ATTENTION)
@pytest.mark.parametrize("requests", CASES)
@pytest.mark.parametrize("num_q_heads,num_kv_heads", [(4, 4), (6, 2), (4, 1)])
@pytest.mark.parametrize("block_size", [4, 6, 16])   # 6: not a power of two (the kernels divide)
def test_paged_attention_matches_dense_sdpa(requests, num_q_heads, num_kv_heads, block_size, attention):
    gen = torch.Generator().manual_seed(0)
    head_dim = 16
    q, k, v, k_cache, v_cache, md, seqs = _build_step(
        requests, block_size, num_kv_heads, num_q_heads, head_dim, torch.float32, gen
    )
    scale = head_dim**-0.5
    store_kv_torch(k, v, k_cache, v_cache, md.slot_mapping)  # this step's tokens, then read them back
    out = attention(q, k_cache, v_cache, md, scale)
    assert out.shape == q.shape
    torch.testing.assert_close(out, _dense_reference(seqs, scale), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("attention", ATTENTION)
def test_paged_attention_bfloat16(attention):
    gen = torch.Generator().manual_seed(0)
    q, k, v, k_cache, v_cache, md, seqs = _build_step(
        [(6, 1), (0, 5), (3, 4), (20, 1)], 4, 2, 4, 16, torch.bfloat16, gen
    )
    store_kv_torch(k, v, k_cache, v_cache, md.slot_mapping)
    out = attention(q, k_cache, v_cache, md, 0.25)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), _dense_reference(seqs, 0.25), atol=2e-2, rtol=2e-2)


def test_cpu_decode_kernel_is_built_here():
    # Without this, the tests above could pass on the torch fallback alone and never run the kernel.
    if not sys.platform.startswith("linux") or shutil.which(os.environ.get("CC", "cc")) is None:
        pytest.skip("the C kernels need Linux and a C compiler")
    assert cpu_kernels.load() is not None


@pytest.mark.parametrize("march", ["sapphirerapids", "x86-64-v3", "x86-64"])
def test_cpu_kernels_compile_for_other_x86_machines(march, tmp_path):
    """Each kernel source compiles (-Werror) for the vector units of machines other than this one:
    Sapphire Rapids (AVX-512 with AVX512-BF16 and AMX: the code under #ifdef AMX), AVX2, and
    SSE. Why: a kernel that breaks only where this CPU does not build it disables every kernel
    there; a second `pack_rows` in gemm.c did exactly that on AMX CPUs (seen only here)."""
    compiler = os.environ.get("CC", "cc")
    if not sys.platform.startswith("linux") or shutil.which(compiler) is None:
        pytest.skip("the C kernels need Linux and a C compiler")
    flags = [f"-march={march}" if f.startswith("-march=") else f for f in cpu_kernels.FLAGS]
    probe = subprocess.run([compiler, f"-march={march}", "-x", "c", "-c", "-", "-o", str(tmp_path / "p.o")],
                           input="int x;", capture_output=True, text=True)
    if probe.returncode:
        pytest.skip(f"{compiler} does not know -march={march}")
    for source in cpu_kernels.SOURCES:
        built = subprocess.run([compiler, *flags, "-c", str(source), "-o", str(tmp_path / "k.o")],
                               capture_output=True, text=True)
        assert built.returncode == 0, f"{source.name}, -march={march}:\n{built.stderr}"


# What code built for each -march needs of the CPU that runs it (/proc/cpuinfo's names; the
# extensions compiled loops can use, not ones only intrinsics reach, such as PKU, which a virtual
# machine may hide), and the vector width its kernels then use. x86-64-v4: AVX-512 without
# AVX512-BF16 (bf16 widened to float32, as on a Skylake or Ice Lake Xeon); cooperlake: AVX512-BF16
# without AMX (the code a Zen 4 or Zen 5 runs); x86-64-v3: AVX2 (8 lanes); x86-64: SSE2 (4 lanes).
V3 = {"avx2", "fma", "bmi1", "bmi2", "f16c", "movbe", "abm"}
V4 = V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}
X86_LEVELS = {"cooperlake": (V4 | {"avx512_vnni", "avx512_bf16"}, 16),
              "x86-64-v4": (V4, 16), "x86-64-v3": (V3, 8), "x86-64": (set(), 4)}
KERNEL_ORACLES = ["tests/test_paged_attention.py", "tests/test_cpu_backend.py", "tests/test_cpu_graphs.py",
                  "tests/test_sampler.py", "tests/test_llm.py"]


@pytest.mark.parametrize("march", list(X86_LEVELS))
def test_cpu_kernels_match_torch_as_other_x86_machines_build_them(march):
    """The kernels' oracle tests (paged == dense, products and norms == torch, the fused step ==
    the model, argmax, greedy == HF), run again on the kernels as a machine of another x86 level
    builds them (NANOSERVE_CPU_MARCH, in a child process). This CPU runs code built for an older
    level, so the loops a machine without AMX, without AVX512-BF16, with AVX2 or with SSE2 only
    takes (8 or 4 lanes, bf16 widened) are run and checked here, not only compiled."""
    compiler = os.environ.get("CC", "cc")
    if not sys.platform.startswith("linux") or shutil.which(compiler) is None:
        pytest.skip("the C kernels need Linux and a C compiler")
    needs, lanes = X86_LEVELS[march]
    missing = needs - set(cpu_kernels._cpu_flags().decode().split())
    if missing:
        pytest.skip(f"this CPU cannot run code built for {march} (no {', '.join(sorted(missing))})")
    env = {**os.environ, "NANOSERVE_CPU_MARCH": march}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    width = subprocess.run([sys.executable, "-c", "from nanoserve.cpu import kernels as k; "
                            "print(k.load().gemm_panel_width())"], env=env, cwd=root,
                           capture_output=True, text=True)
    assert width.returncode == 0, width.stderr[-3000:]
    assert int(width.stdout) == 3 * lanes   # gemm.c's panel: 3 vectors of LANES floats
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *KERNEL_ORACLES,
                          "-k", "not other_x86_machines"], env=env, cwd=root, capture_output=True, text=True)
    assert run.returncode == 0, f"-march={march}:\n{run.stdout[-6000:]}{run.stderr[-2000:]}"


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("use_kernel", [True, False], ids=["kernel", "torch-fallback"])
@pytest.mark.parametrize("head_dim", [64, 128, 40, 42])
def test_cpu_decodes_at_model_shape(dtype, tol, use_kernel, head_dim, monkeypatch):
    """SmolLM2-135M's attention shape (9 query heads on 3 KV heads, head_dim 64), long decodes
    across many blocks beside a prefill, through the CPU form with and without the C kernels
    (without: every request falls back to the torch loop, attend_each). head_dim 64 and 128 take
    the kernel's SIMD loops on every CPU; 40 takes them with 8 lanes (AVX2) and the plain loops
    with 16 (AVX-512); 42 (no multiple of any vector width) takes the plain loops everywhere."""
    if use_kernel and cpu_kernels.load() is None:
        pytest.skip("no C compiler here")
    if not use_kernel:
        monkeypatch.setattr(cpu_kernels, "load", lambda: None)
    gen = torch.Generator().manual_seed(1)
    requests = [(199, 1), (0, 9), (64, 1), (15, 1), (33, 2), (130, 1)]
    q, k, v, k_cache, v_cache, md, seqs = _build_step(requests, 16, 3, 9, head_dim, dtype, gen)
    store_kv_torch(k, v, k_cache, v_cache, md.slot_mapping)
    scale = head_dim**-0.5
    torch_loop, calls = cpu_ops.attend_each, []
    monkeypatch.setattr(cpu_ops, "attend_each", lambda *a: calls.append(list(a[-1])) or torch_loop(*a))
    out = paged_attention_cpu(q, k_cache, v_cache, md, scale)
    # with the kernels no request is left to the loop; without them, every one
    assert calls == ([] if use_kernel else [[0, 2, 3, 5, 1, 4]])
    torch.testing.assert_close(out.float(), _dense_reference(seqs, scale), atol=tol, rtol=tol)


@pytest.mark.skipif(cpu_kernels.load() is None, reason="no C compiler here")
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("head_dim", [64, 128, 42])
@pytest.mark.parametrize("block_size", [4, 16])
def test_cpu_prefill_kernel_matches_dense(dtype, tol, head_dim, block_size, monkeypatch):
    """The prefill kernel alone (the torch loop must not run): prompts longer than one tile of
    query lanes, chunks behind a cached prefix that crosses blocks, a 2-token chunk, GQA."""
    def no_torch_loop(*args):
        raise AssertionError("a request fell back to the torch loop")
    monkeypatch.setattr(cpu_ops, "attend_each", no_torch_loop)
    gen = torch.Generator().manual_seed(2)
    requests = [(0, 37), (21, 17), (0, 2), (100, 50), (7, 1)]
    q, k, v, k_cache, v_cache, md, seqs = _build_step(requests, block_size, 3, 9, head_dim, dtype, gen)
    store_kv_torch(k, v, k_cache, v_cache, md.slot_mapping)
    scale = head_dim**-0.5
    out = paged_attention_cpu(q, k_cache, v_cache, md, scale)
    torch.testing.assert_close(out.float(), _dense_reference(seqs, scale), atol=tol, rtol=tol)


@pytest.mark.skipif(cpu_kernels.load() is None, reason="no C compiler here")
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_cpu_verification_runs_as_decodes(dtype, tol, monkeypatch):
    """With speculation (max_decode_query_len = 1 + k) a request of up to k + 1 query tokens is
    one decode_attention.c task per token, each seeing the keys up to its own position: the
    dense causal result, with no request left to the prefill kernel or the torch loop."""
    def no_other_path(*args):
        raise AssertionError("a verification went to another path than decode_attention.c")
    monkeypatch.setattr(cpu_ops, "attend_each", no_other_path)
    gen = torch.Generator().manual_seed(3)
    requests = [(30, 5), (7, 1), (15, 3), (2, 2), (40, 1)]    # block edges crossed inside a query
    q, k, v, k_cache, v_cache, md, seqs = _build_step(requests, 4, 2, 6, 32, dtype, gen)
    store_kv_torch(k, v, k_cache, v_cache, md.slot_mapping)
    md = cpu_ops.CpuAttentionMetadata.of(md, max_decode_query_len=5)
    assert not md.others.indices and md.decodes.arguments[-2] == 12    # 12 tokens, 12 tasks
    assert md.decodes.seq_lens.tolist()[:5] == [31, 32, 33, 34, 35]
    monkeypatch.setattr(cpu_kernels, "attention_kernel", functools.partial(
        _only_decode_attention, cpu_kernels.attention_kernel))
    out = paged_attention_cpu(q, k_cache, v_cache, md, 32**-0.5)
    torch.testing.assert_close(out.float(), _dense_reference(seqs, 32**-0.5), atol=tol, rtol=tol)


def _only_decode_attention(kernel, name, *args):
    assert name == "decode_attention", f"{name} ran in a step of decodes and verifications"
    return kernel(name, *args)


def test_store_kv_worked_example():
    # block_table [7, 1, 3], block_size 4: position 9 -> block 3, offset 1 -> slot 13.
    block_size, num_kv_heads, head_dim = 4, 2, 8
    k_cache = torch.zeros(8, block_size, num_kv_heads, head_dim)
    v_cache = torch.zeros_like(k_cache)
    block_table = torch.tensor([7, 1, 3])
    positions = torch.arange(10)
    slot_mapping = block_table[positions // block_size] * block_size + positions % block_size
    assert slot_mapping[9].item() == 13
    key = torch.randn(10, num_kv_heads, head_dim)
    value = torch.randn(10, num_kv_heads, head_dim)
    store_kv_torch(key, value, k_cache, v_cache, slot_mapping)
    for p in range(10):
        block, offset = block_table[p // block_size], p % block_size
        assert torch.equal(k_cache[block, offset], key[p])
        assert torch.equal(v_cache[block, offset], value[p])
    assert torch.equal(k_cache[3, 1], key[9])
    assert k_cache[[0, 2, 4, 5, 6]].abs().sum() == 0  # blocks outside the table untouched


@pytest.mark.parametrize(
    "field,kwargs",
    [
        ("slot_mapping", dict(slot_mapping=torch.zeros(2, 2, dtype=torch.int64))),
        ("slot_mapping", dict(slot_mapping=torch.tensor([13, 20, 21, 22], dtype=torch.int32))),
        ("block_tables", dict(block_tables=torch.zeros(3, 4, dtype=torch.int32))),
        ("query_start_loc", dict(query_start_loc=torch.tensor([0, 1], dtype=torch.int32))),
        ("seq_lens", dict(seq_lens=torch.zeros(2, 1, dtype=torch.int32))),
    ],
)
def test_metadata_shape_errors_name_the_field(field, kwargs):
    good = dict(
        slot_mapping=torch.tensor([13, 20, 21, 22]),
        block_tables=torch.tensor([[7, 1, 3], [5, 0, 0]], dtype=torch.int32),
        seq_lens=torch.tensor([10, 3], dtype=torch.int32),
        query_start_loc=torch.tensor([0, 1, 4], dtype=torch.int32),
        max_query_len=3,
    )
    AttentionMetadata(**good)
    with pytest.raises(ValueError, match=field):
        AttentionMetadata(**{**good, **kwargs})


@pytest.mark.skipif(cpu_kernels.load() is None, reason="no C compiler here")
def test_loading_the_cpu_kernel_keeps_subnormal_floats():
    """A library linked with -ffast-math (GCC's crtfastmath.o) would switch the whole process to
    flush-to-zero when it loads: every float below 1.2e-38 anywhere in the user's code -> 0."""
    script = ("import torch; from nanoserve.cpu import kernels as k; assert k.load(); "
              "print((torch.tensor([1e-39]) * 1.0).item() != 0.0)")
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert run.stdout.strip() == "True"
