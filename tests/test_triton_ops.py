"""Oracle tests for the CUDA backend's Triton forms of the row ops: each == its torch reference.

    rms_norm_triton            == RMSNorm.forward_native, with and without the residual add
    rope_store_kv_triton       == RopeStoreKV.forward_native (q/k/v views of one qkv tensor, slot -1)
    silu_and_mul_triton        == SiluAndMul.forward_native
    per_token_quant_fp8_triton == quantized.per_token_quant_fp8_torch, and through _scaled_mm
    cuda/backend.bind          binds each of them (and attention) and warms every variant

Runs on CPU through the Triton interpreter (no GPU needed), in about half a minute:
    pytest -q tests/test_triton_ops.py
On a GPU machine, TRITON_INTERPRET=0 runs the same tests on the compiled kernels.
tests/test_gpu_path.py compiles each of these kernels for sm_90 on CPU (AOT, down to a cubin).

The interpreter differs from a GPU in two roundings (triton 3.9): float32 -> bfloat16 truncates
instead of rounding to nearest, and float32 -> e4m3 drops the carry when rounding up crosses a
power of two (124.4 -> 64, not 128). The bf16 checks allow two bf16 steps; the fp8 check allows
exactly that carry and ties rounded away from even (another interpreter rounding), only when
interpreted.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # must happen before triton is imported

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from nanoserve.cuda.quantized import per_token_quant_fp8_torch, scaled_mm_linear  # noqa: E402
from nanoserve.layers import Linear, RMSNorm, RopeStoreKV, SiluAndMul  # noqa: E402
from nanoserve.quantization import quantize  # noqa: E402
from triton_kit import triton_modules  # noqa: E402

INTERPRET = os.environ["TRITON_INTERPRET"] == "1"
DEVICE = "cpu" if INTERPRET else "cuda"
if not INTERPRET and not torch.cuda.is_available():
    pytest.skip("TRITON_INTERPRET=0 needs a CUDA device", allow_module_level=True)
pat, dat, nr, act, _, cuda_backend = triton_modules()

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# bf16: two bf16 steps (2^-7 relative each, or 2^-7 near 1 where RoPE's sums cancel) where the
# interpreter truncates twice; fp16 and float32 round as torch.
TOL = {torch.float32: (1e-6, 1e-6), torch.float16: (1e-3, 1e-3), torch.bfloat16: (1e-2, 1.6e-2)}


def randn(*shape, dtype, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype).to(DEVICE)


def close(actual, expected, dtype):
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(actual, expected, atol=atol, rtol=rtol, equal_nan=True)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_matches_forward_native(dtype):
    norm = RMSNorm(48, eps=1e-5).to(DEVICE)   # 48: not a power of two, masked lanes
    norm.weight.data = randn(48, dtype=torch.float32, seed=1).to(dtype)
    norm = norm.to(dtype)
    x, residual = randn(5, 48, dtype=dtype, seed=2) * 3, randn(5, 48, dtype=dtype, seed=3)
    close(nr.rms_norm_triton(norm.weight, norm.eps, x), norm.forward_native(x), dtype)
    ours, theirs = residual.clone(), residual.clone()
    out, r = nr.rms_norm_triton(norm.weight, norm.eps, x, ours)
    expected, expected_r = norm.forward_native(x, theirs)
    assert r is ours  # updated in place, as residual.add_ does
    close(out, expected, dtype)
    if dtype == torch.bfloat16 and INTERPRET:
        close(r, expected_r, dtype)
    else:  # the sum is one rounding to the dtype, as torch's add_ makes it
        assert torch.equal(r, expected_r)


def test_rms_norm_on_heads_of_a_qkv_view():
    # Qwen3 normalises each head of q and k: [tokens, heads, head_dim] views of the qkv rows.
    norm = RMSNorm(16, eps=1e-6).to(DEVICE)
    norm.weight.data = randn(16, dtype=torch.float32, seed=4)
    qkv = randn(3, 4 + 2 + 2, 16, dtype=torch.float32, seed=5)
    for view in (qkv[:, :4], qkv[:, 4:6]):
        close(nr.rms_norm_triton(norm.weight, norm.eps, view), norm.forward_native(view),
              torch.float32)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_store_kv_matches_forward_native(dtype):
    tokens, hq, hkv, d, bs = 6, 6, 2, 32, 4     # 6 q heads: a non-power-of-two head count
    qkv = randn(tokens, hq + 2 * hkv, d, dtype=dtype, seed=6)
    q, k, v = qkv.split([hq, hkv, hkv], dim=1)    # non-contiguous rows, as the model hands them
    angles = randn(tokens, 1, d // 2, dtype=torch.float32, seed=7) * 3
    rope = angles.cos().to(dtype), angles.sin().to(dtype)
    slot_mapping = torch.tensor([13, 0, -1, 19, 6, -1], device=DEVICE)  # -1: PAD_SLOT_ID
    caches = torch.full((2, 5, bs, hkv, d), float("nan"), dtype=dtype, device=DEVICE)
    expected_caches = caches.clone()
    out = nr.rope_store_kv_triton(*rope, q, k, v, caches[0], caches[1], slot_mapping)
    expected = RopeStoreKV().forward_native(rope, q, k, v, tuple(expected_caches), slot_mapping)
    close(out, expected, dtype)
    close(caches, expected_caches, dtype)   # NaN where nothing was stored: the padded rows too
    assert caches[:, 3, 1].isfinite().all() and caches.isnan().sum() == 2 * (5 * bs - 4) * hkv * d


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_matches_forward_native(dtype):
    gate_up = randn(7, 2, 2 * 40, dtype=dtype, seed=8) * 4    # [..., 2 * 40]: 3-D, 40 masked
    out = act.silu_and_mul_triton(gate_up)
    assert out.shape == (7, 2, 40)
    close(out, SiluAndMul().forward_native(gate_up), dtype)


def fp8_equal(ours: torch.Tensor, reference: torch.Tensor, exact: torch.Tensor) -> bool:
    """Equal e4m3 values, save (interpreted only) the interpreter's two roundings: a lost carry
    (the reference a power of two, ours half of it) and a tie rounded away from even (`exact`,
    the unrounded value, halfway between ours and the reference)."""
    a, b = ours.float(), reference.float()
    if not INTERPRET:
        return torch.equal(a, b)
    lost_carry = (a * 2 == b) & (torch.frexp(b).mantissa.abs() == 0.5)
    return bool(((a == b) | lost_carry | ((a + b) / 2 == exact)).all())


def test_per_token_quant_fp8_matches_torch():
    rows = randn(6, 300, dtype=torch.bfloat16, seed=9) * torch.tensor(
        [1.0, 1e-3, 100.0, 0.0, 3.0, 1.0], device=DEVICE)[:, None].bfloat16()   # a zero row too
    rows[5, 17] = 40.0   # one outlier sets its row's scale
    quantized, scale = act.per_token_quant_fp8_triton(rows)
    expected, expected_scale = per_token_quant_fp8_torch(rows)
    assert quantized.dtype == torch.float8_e4m3fn and scale.shape == (6, 1)
    assert torch.equal(scale, expected_scale)
    assert fp8_equal(quantized, expected, rows.float() / expected_scale)
    assert quantized[5, 17].float() == 448 and (quantized[3].float() == 0).all()


@pytest.mark.skipif(INTERPRET, reason="the interpreter's e4m3 roundings (module docstring) move "
                                      "whole products; the kernel's values are checked above")
def test_fp8_product_with_the_kernel_equals_the_torch_quantization():
    linear = Linear(64, 32, bias=True, quantization="fp8").to(DEVICE)
    linear.weight.data, linear.weight_scale = quantize(randn(32, 64, dtype=torch.float32), "fp8")
    linear.bias.data = randn(32, dtype=torch.bfloat16, seed=10)
    x = randn(2, 5, 64, dtype=torch.bfloat16, seed=11)
    ours = scaled_mm_linear(linear, x, quantize_rows=act.per_token_quant_fp8_triton)
    assert torch.equal(ours, scaled_mm_linear(linear, x))


def test_bind_gives_every_op_but_the_products_its_triton_form(monkeypatch):
    """cuda/backend.bind on a tiny Llama, on CPU (interpreted; the GPU's capability faked): each
    op bound, and the warm-ups (compile_kernels, compile_row_ops) run on the model's shapes."""
    from transformers import LlamaConfig

    from nanoserve.config import Config
    from nanoserve.layers import Attention
    from nanoserve.models.llama import LlamaForCausalLM
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: (9, 0))
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48,
                                         num_hidden_layers=1, num_attention_heads=4,
                                         num_key_value_heads=2)).to(DEVICE)
    backend = cuda_backend.bind(model, Config(enforce_eager=True), {})
    assert backend.forward is model and not backend.cudagraph_capture_sizes
    for module in model.modules():
        if isinstance(module, (RMSNorm, SiluAndMul, RopeStoreKV, Attention)):
            assert module.impl != module.forward_native, type(module).__name__
        elif isinstance(module, Linear):
            assert module.impl == module.forward_native   # not fp8: cuBLAS
