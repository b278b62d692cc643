"""The CPU backend's fused step (cpu/fused.py) against the same model on the unfused CPU forms:
the same steps (prefills, a mixed step, decodes), the same bits, in the output and in the KV cache
it writes; against the torch reference within dtype rounding; and the models it must leave unfused.

    pytest -q tests/test_cpu_fused.py
"""

import pytest
import torch
from transformers import LlamaConfig, Qwen3Config

from nanoserve.attention_metadata import AttentionMetadata
from nanoserve.config import Config
from nanoserve.cpu import kernels as cpu_kernels
from nanoserve.cpu.backend import bind
from nanoserve.cpu.fused import FusedStep
from nanoserve.models import get_model_class

# Inputs multiples of 32 and an intermediate size a multiple of 16, as the AMX product needs.
TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
BLOCK = 4
# Every product on gemm.c (kernel, amx) or on another path (torch: the step calls the Gemm).
PATHS = [(torch.float32, "kernel"), (torch.bfloat16, "kernel"), (torch.bfloat16, "amx"),
         (torch.float32, "torch"), (torch.bfloat16, "onednn")]
# (cached, new) per request, step by step: prefills, then a step with a prefill beside decodes,
# then decodes only (decode_attention.c called straight from the loop).
STEPS = [([0, 0, 0, 0], [7, 13, 2, 21]), ([7, 13, 2, 21, 0], [1, 1, 1, 1, 5])] + [
    ([8 + t, 14 + t, 3 + t, 22 + t, 5 + t], [1] * 5) for t in range(3)]

pytestmark = pytest.mark.skipif(cpu_kernels.load() is None, reason="no C compiler here")


def make_model(dtype, cfg=None, bias=False):
    cfg = cfg or LlamaConfig(**TINY, attention_bias=bias, mlp_bias=bias, architectures=["LlamaForCausalLM"])
    torch.manual_seed(0)
    model = get_model_class(cfg)(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn_like(p) * 0.2 + (1.0 if "norm" in name else 0.0))
    return model.to(dtype)


def bound(dtype, path, monkeypatch, fused: bool, bias=False):
    """A model with the CPU backend bound (`path` forced for every product): its Backend."""
    monkeypatch.setenv("NANOSERVE_CPU_FUSION", "1" if fused else "0")
    backend = bind(make_model(dtype, bias=bias), Config(cpu_gemm=path))
    assert isinstance(backend.forward, FusedStep) == fused
    return backend


def step(lengths: list[int], new: list[int]):
    """(positions, AttentionMetadata) for requests with `lengths` tokens cached before this step
    and `new` tokens in it; request i's blocks are 8 * i, 8 * i + 1, ... (room for 32 tokens)."""
    tables = [[8 * i + b for b in range(-(-(c + n) // BLOCK))] for i, (c, n) in enumerate(zip(lengths, new))]
    positions = [p for c, n in zip(lengths, new) for p in range(c, c + n)]
    slots = [tables[i][p // BLOCK] * BLOCK + p % BLOCK
             for i, (c, n) in enumerate(zip(lengths, new)) for p in range(c, c + n)]
    width = max(map(len, tables))
    starts = [0]
    for n in new:
        starts.append(starts[-1] + n)
    md = AttentionMetadata(
        slot_mapping=torch.tensor(slots), seq_lens=torch.tensor([c + n for c, n in zip(lengths, new)], dtype=torch.int32),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        query_start_loc=torch.tensor(starts, dtype=torch.int32), max_query_len=max(new))
    return torch.tensor(positions), md


def caches(dtype):
    shape = (8 * 8, BLOCK, TINY["num_key_value_heads"], TINY["hidden_size"] // TINY["num_attention_heads"])
    return [(torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)) for _ in range(TINY["num_hidden_layers"])]


def run(backend, dtype):
    """Every step of STEPS through `backend`: (each step's hidden states, the KV caches after)."""
    kv, outs = caches(dtype), []
    with torch.inference_mode():
        for t, (lengths, new) in enumerate(STEPS):
            positions, md = step(lengths, new)
            ids = torch.randint(0, 128, (sum(new),), generator=torch.Generator().manual_seed(t))
            outs.append(backend.forward(ids, positions, kv, backend.build_metadata(md)))
    return outs, kv


@pytest.mark.parametrize("dtype, path", PATHS)
@pytest.mark.parametrize("bias", [False, True])
def test_fused_step_equals_the_unfused_backend_to_the_bit(dtype, path, bias, monkeypatch):
    if path == "amx" and not cpu_kernels.gemm_amx_ready():
        pytest.skip("no AMX on this CPU")
    fused, fused_kv = run(bound(dtype, path, monkeypatch, True, bias), dtype)
    unfused, unfused_kv = run(bound(dtype, path, monkeypatch, False, bias), dtype)
    for t, (ours, theirs) in enumerate(zip(fused, unfused)):
        assert torch.equal(ours, theirs), t
    for (k, v), (k2, v2) in zip(fused_kv, unfused_kv):
        assert torch.equal(k, k2) and torch.equal(v, v2)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-4), (torch.bfloat16, 6e-2)])
def test_fused_step_equals_the_torch_reference(dtype, tol, monkeypatch):
    """The fused step (gemm.c's products with the norm and silu inside) against the plain model on
    the torch ops, within the dtype's rounding."""
    ours, _ = run(bound(dtype, "kernel", monkeypatch, True), dtype)
    model = make_model(dtype)
    theirs, _ = run(type("Native", (), {"forward": model, "build_metadata": staticmethod(lambda md: md)}), dtype)
    for t, (a, b) in enumerate(zip(ours, theirs)):
        torch.testing.assert_close(a.float(), b.float(), atol=tol, rtol=tol, msg=lambda m: f"step {t}: {m}")


def test_fused_step_leaves_the_unfused_forms_what_it_cannot_run(monkeypatch):
    monkeypatch.setenv("NANOSERVE_CPU_FUSION", "1")
    qwen3 = Qwen3Config(**TINY, head_dim=16, architectures=["Qwen3ForCausalLM"])
    assert not FusedStep.supports(make_model(torch.float32, qwen3))     # q/k norms between
    assert not FusedStep.supports(make_model(torch.float16))            # no kernels for fp16
    model = make_model(torch.float32, qwen3)
    assert bind(model, Config(cpu_gemm="kernel")).forward is model


@pytest.mark.skipif(not cpu_kernels.gemm_amx_ready(), reason="no AMX on this CPU")
def test_rows_above_the_amx_loop_run_as_the_gemm_does(monkeypatch):
    """A product whose AMX loop stops below the step's rows: F.linear, through its Gemm."""
    fused = bound(torch.bfloat16, "amx", monkeypatch, True)
    for layer in fused.forward.layers:
        object.__setattr__(layer.down.gemm, "loop_rows", 2)
    fused.forward.layers = [layer._replace(down=layer.down._replace(max_rows=2)) for layer in fused.forward.layers]
    ours, _ = run(fused, torch.bfloat16)
    theirs, _ = run(bound(torch.bfloat16, "amx", monkeypatch, False), torch.bfloat16)
    for t, (a, b) in enumerate(zip(ours, theirs)):
        torch.testing.assert_close(a, b, atol=0.05, rtol=2**-6, msg=lambda m: f"step {t}: {m}")
