"""FusedMoE's backend forms == its torch reference (layers.FusedMoE.forward_native).

    cpu/moe.py                 the CPU form (grouped by expert, each expert's products on a
                               gemm.py path, or all in one gemm.c call on AMX), float32 and bf16,
                               int8 and fp8 weights
    cpu/graphs.py              a decode step of a model whose MLPs are FusedMoE replays == the same
                               step run eagerly, to the bit, the MoE recorded as one opaque call

Each form on the same cases: tokens spread over the experts, a single token (most experts get
none), top_k 1 and 2, every token on one expert (or two), and a rank holding a subset of the
experts (expert_ids) in an order of its own, where the pairs routed elsewhere contribute nothing.

    pytest -q tests/test_fused_moe.py      # about a minute; TRITON_INTERPRET=0 on a GPU for the kernel
"""

import copy
import functools
import os
import sys
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")  # must happen before triton is imported

import pytest  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402

from nanoserve.config import Config  # noqa: E402
from nanoserve.cpu import kernels as cpu_kernels  # noqa: E402
from nanoserve.cpu.moe import CpuFusedMoE  # noqa: E402
from nanoserve.layers import FusedMoE, Linear  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
import moe_kit  # noqa: E402

HIDDEN, INTERMEDIATE, EXPERTS = 32, 24, 8    # 2 * 24 = 48 rows of w13: not a power of two
# name: (top_k, expert_ids (None: all 8), tokens, logits added to the random ones to steer routing)
CASES = {
    "spread": (2, None, 7, {}),
    "one token": (2, None, 1, {}),
    "top_k 1": (1, None, 7, {}),
    "all on one expert": (1, None, 6, {3: 20.0}),
    "all on two experts": (2, None, 6, {3: 20.0, 5: 19.0}),
    "a subset held": (2, [5, 1, 6, 2], 7, {}),
}
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=1.6e-2)}


def random_moe(top_k, expert_ids, dtype, quantization=None, seed=0, hidden=HIDDEN) -> FusedMoE:
    """A FusedMoE of this file's shape with random weights (scripts/moe_kit.py)."""
    return moe_kit.random_moe(EXPERTS, top_k, hidden, INTERMEDIATE, dtype, quantization,
                              expert_ids, renormalize=top_k > 1, seed=seed)


def inputs(tokens, steer, dtype, seed=1):
    g = torch.Generator().manual_seed(seed)
    hidden, logits = torch.randn(tokens, HIDDEN, generator=g).to(dtype), torch.randn(tokens, EXPERTS, generator=g)
    for expert, bias in steer.items():
        logits[:, expert] += bias
    return hidden, logits.to(dtype)


def check_case(form, case, dtype, quantization=None, tol=None):
    """form(op, hidden, logits) == op.forward_native(hidden, logits) on CASES[case]."""
    top_k, expert_ids, tokens, steer = CASES[case]
    op = random_moe(top_k, expert_ids, dtype, quantization)
    hidden, logits = inputs(tokens, steer, dtype)
    with torch.inference_mode():
        expected = op.forward_native(hidden, logits)
        out = form(op, hidden, logits)
    assert out.shape == hidden.shape and out.dtype == dtype
    torch.testing.assert_close(out, expected, **(tol or TOL[dtype]))


# -------------------------------------------------------------------------------- the CPU form

needs_kernels = pytest.mark.skipif(cpu_kernels.load() is None, reason="no C compiler here")


def cpu_form(path):
    def form(op, hidden, logits):
        paths = {}
        out = CpuFusedMoE(op, hidden.dtype, Config(cpu_gemm=path), paths).forward(hidden, logits)
        assert set(paths.values()) == {path} and op.w13_weight is None   # the Gemms hold the weights
        return out
    return form


@needs_kernels
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_form_matches_forward_native(case, dtype):
    check_case(cpu_form("kernel"), case, dtype)


@pytest.mark.parametrize("case", ["spread", "a subset held"])
def test_cpu_form_on_torch_products_matches_forward_native(case):
    """F.linear for the products (where no C compiler is, and what gemm.py may pick): in bf16 the
    same numbers, rounding for rounding, since the sums come in forward_native's order."""
    check_case(cpu_form("torch"), case, torch.bfloat16, tol=dict(atol=0, rtol=0))


@pytest.mark.parametrize("quantization, path", [("int8", "kernel"), ("int8", "torch"), ("fp8", "torch")])
def test_cpu_form_on_quantized_experts(quantization, path):
    if path == "kernel" and cpu_kernels.load() is None:
        pytest.skip("no C compiler here")
    for case in ("spread", "a subset held"):
        check_case(cpu_form(path), case, torch.bfloat16, quantization)


@pytest.mark.skipif(not cpu_kernels.gemm_amx_ready(), reason="no AMX here")
@pytest.mark.parametrize("case", ["spread", "all on one expert", "a subset held"])
@pytest.mark.parametrize("tokens", [5, 700])
def test_cpu_form_on_amx_runs_every_expert_in_one_call(case, tokens):
    """The amx path: all experts in one gemm.c call (moe_amx), at a decode step's few rows and at
    a prefill's hundreds an expert (700 on one: past the rows where a Linear's amx product hands
    over to F.linear). AMX needs the inputs a multiple of 32: hidden 64, intermediate 32."""
    top_k, expert_ids, _, steer = CASES[case]
    op = moe_kit.random_moe(EXPERTS, top_k, 64, 32, torch.bfloat16, None, expert_ids, top_k > 1)
    g = torch.Generator().manual_seed(tokens)
    hidden, logits = torch.randn(tokens, 64, generator=g).to(torch.bfloat16), torch.randn(tokens, EXPERTS, generator=g)
    for expert, bias in steer.items():
        logits[:, expert] += bias
    with torch.inference_mode():
        expected = op.forward_native(hidden, logits)
        form = CpuFusedMoE(op, torch.bfloat16, Config(cpu_gemm="amx"), {})
        assert form.grouped is not None and not form.experts
        torch.testing.assert_close(form.forward(hidden, logits), expected, **TOL[torch.bfloat16])


# ------------------------------------------------------------------ capture and replay on the CPU


class MoeMLP(nn.Module):
    """A Qwen3-MoE / Mixtral block in the seam's ops: the router's Linear, then the experts."""

    def __init__(self, hidden_size, dtype, seed):
        super().__init__()
        self.gate = Linear(hidden_size, EXPERTS, bias=False)
        self.gate.weight.data = torch.randn(EXPERTS, hidden_size, generator=torch.Generator().manual_seed(seed))
        self.experts = random_moe(2, None, torch.float32, seed=seed, hidden=hidden_size)
        self.to(dtype)

    def forward(self, x):
        return self.experts(x, self.gate(x))


def moe_model(dtype):
    """test_cpu_graphs' tiny Llama with a MoeMLP in each layer's place of its MLP."""
    from test_cpu_graphs import TINY, make_model
    model = make_model(dtype)
    for i, layer in enumerate(model.model.layers):
        layer.mlp = MoeMLP(TINY["hidden_size"], dtype, seed=i)
    return model


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_moe_decode_steps_replay_as_they_run_eagerly(dtype, monkeypatch):
    """test_cpu_graphs' steps (prefills, a mixed step, decodes of 5 and 3 requests padded to 8
    and 4): each decode step replayed, its routing decided afresh from its values, == eager."""
    from test_cpu_graphs import Counting, assert_same, run
    counting = Counting(monkeypatch)
    replayed = run(moe_model(dtype), dtype, "kernel", eager=False)
    assert counting.replays == 4
    assert_same(replayed, run(moe_model(dtype), dtype, "kernel", eager=True))


@needs_kernels
def test_the_moe_is_one_opaque_call_of_the_record():
    """bind gives FusedMoE its CPU form; the record holds it as one call a layer, on buffers of
    the arena, and none of the work inside it (no gemm of an expert, no data-dependent op)."""
    from test_cpu_graphs import TINY, captured
    model, backend, _, _ = captured(model=moe_model(torch.float32))
    for layer in model.model.layers:
        assert layer.mlp.experts.impl.__self__.__class__ is CpuFusedMoE
    graph = backend.forward.graphs[8][0]
    kernels = [call.kernel for call in graph.record if call.kernel]
    assert kernels == ["rms_norm", "gemm", "rope_store_kv", "decode_attention", "gemm", "rms_norm",
                       "gemm"] * TINY["num_hidden_layers"] + ["rms_norm"]    # the last gemm: the router
    moe_calls = [call for call in graph.record if getattr(call.fn, "__func__", None) is CpuFusedMoE.compute_into]
    assert len(moe_calls) == TINY["num_hidden_layers"]
    assert all(isinstance(arg, type(graph.output_ref)) for call in moe_calls for arg in call.args)
    assert not [call for call in graph.record if "nonzero" in str(call.fn) or "sort" in str(call.fn)]


# ----------------------------------------------------------------------------- the Triton form

INTERPRET = os.environ["TRITON_INTERPRET"] == "1"
DEVICE = "cpu" if INTERPRET else "cuda"
# The interpreter's tl.dot multiplies bf16's raw uint16 bits (test_paged_attention_triton.py), so
# bf16 runs on GPUs only; float16 takes the kernel's 16-bit path through the interpreter.
TRITON_DTYPES = [torch.float32, torch.float16, pytest.param(torch.bfloat16, marks=pytest.mark.skipif(
    INTERPRET, reason="Triton interpreter has no bfloat16 tl.dot"))]
TRITON_TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=2e-3, rtol=2e-3),
              torch.bfloat16: TOL[torch.bfloat16]}


@pytest.fixture(scope="module")
def triton_moe():
    pytest.importorskip("triton")
    if not INTERPRET and not torch.cuda.is_available():
        pytest.skip("TRITON_INTERPRET=0 needs a CUDA device")
    from triton_kit import triton_modules
    return triton_modules()[4]


def triton_form(module):
    def form(op, hidden, logits):
        op = op.to(DEVICE)
        return module.fused_moe_triton(op, module.expert_map(op), hidden.to(DEVICE), logits.to(DEVICE)).cpu()
    return form


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", TRITON_DTYPES)
def test_triton_form_matches_forward_native(triton_moe, case, dtype):
    check_case(triton_form(triton_moe), case, dtype, tol=TRITON_TOL[dtype])


@pytest.mark.parametrize("quantization", ["int8", "fp8"])
@pytest.mark.parametrize("dtype", TRITON_DTYPES)
def test_triton_form_on_quantized_experts(triton_moe, quantization, dtype):
    """The weights widened in the kernel and scaled per output channel after the sums."""
    for case in ("spread", "a subset held"):
        check_case(triton_form(triton_moe), case, dtype, quantization, tol=TRITON_TOL[dtype])


def test_moe_align_block_size_on_the_docstring_example(triton_moe):
    """fused_moe_triton's docstring: 2 tokens, top-2, ids [[2, 0], [2, 1]], blocks of 4; and a
    rank holding experts 2 and 0 (in that order), where expert 1's block is -1."""
    ids = torch.tensor([[2, 0], [2, 1]], device=DEVICE)
    local_of = functools.partial(torch.tensor, dtype=torch.int32, device=DEVICE)
    sorted_ids, expert_ids, post = triton_moe.moe_align_block_size(ids, 4, local_of([0, 1, 2]))
    assert sorted_ids.tolist()[:12] == [1, 4, 4, 4, 3, 4, 4, 4, 0, 2, 4, 4] and post.tolist() == [12]
    assert sorted_ids.shape[0] == 4 + 3 * 3 and expert_ids.tolist()[:3] == [0, 1, 2]
    _, expert_ids, _ = triton_moe.moe_align_block_size(ids, 4, local_of([1, -1, 0]))
    assert expert_ids.tolist()[:3] == [1, -1, 0]


def test_cuda_bind_gives_fused_moe_its_triton_form(triton_moe, monkeypatch):
    """cuda/backend.bind (interpreted; the GPU's capability faked) on the tiny Llama with MoE MLPs:
    each FusedMoE bound to fused_moe_triton == its forward_native, and warmed at both tiles."""
    from triton_kit import triton_modules
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: (9, 0))
    warmed, real = [], triton_moe.moe_config
    monkeypatch.setattr(triton_moe, "moe_config",
                        lambda tokens, experts: warmed.append(tokens) or real(tokens, experts))
    model = moe_model(torch.float32).to(DEVICE)
    reference = copy.deepcopy(model.model.layers[0].mlp.experts)
    triton_modules()[-1].bind(model, Config(enforce_eager=True), {})
    # compile_row_ops' two-token run through the model (each layer: the small tile), then one
    # FusedMoE shape at one token more than its experts (the large tile)
    assert set(warmed) == {2, EXPERTS + 1} and warmed[-1] == EXPERTS + 1 and 2 <= EXPERTS
    moe = model.model.layers[0].mlp.experts
    assert moe.impl.func is triton_moe.fused_moe_triton
    hidden, logits = (t.to(DEVICE) for t in inputs(5, {}, torch.float32))
    hidden = torch.cat([hidden, -hidden], dim=1)     # the model's width: 64
    with torch.inference_mode():
        torch.testing.assert_close(moe(hidden, logits), reference.forward_native(hidden, logits),
                                   **TRITON_TOL[torch.float32])
