"""The CPU backend (nanoserve/cpu/): each CPU form == the torch reference it replaces.

    gemm.py     every product path (torch, oneDNN, gemm.c, AMX): `.product(x)` == F.linear, the
                Linear op's forward_native, on ragged shapes too; choose_cpu_gemms on a tiny Llama
    ops.py      rms_norm, silu_and_mul, rope_store_kv (and the raw C kernels under them) == the
                ops' forward_native, and the fallback to it where a kernel cannot take the tensors
    backend.py  bind gives every op its CPU form; without the kernels, the torch reference stays

Attention's CPU form (paged_attention_cpu) is tested in tests/test_paged_attention.py, the whole
model on the backend against HF in tests/test_models.py, capture and replay in
tests/test_cpu_graphs.py.

    pytest -q tests/test_cpu_backend.py
"""

import functools
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig

from nanoserve.config import Config
from nanoserve.cpu import kernels as cpu_kernels
from nanoserve.cpu import ops
from nanoserve.cpu.gemm import (AmxGemm, KernelGemm, PackedGemm, TorchGemm, amx_loop_rows,
                                candidate_paths, choose_cpu_gemms, make_gemm)
from nanoserve.distributed import SINGLE
from nanoserve.layers import (Attention, Linear, RMSNorm, RopeStoreKV, SiluAndMul, apply_rope,
                              gemm_label)
from nanoserve.models import LlamaForCausalLM
from nanoserve.models.llama import LlamaMLP, RotaryEmbedding

needs_kernels = pytest.mark.skipif(cpu_kernels.load() is None, reason="no C compiler here")
needs_amx = pytest.mark.skipif(not cpu_kernels.gemm_amx_ready(), reason="no AMX on this CPU")
NATIVE_SILU_AND_MUL = SiluAndMul().forward_native
PATH_CLASS = {"torch": TorchGemm, "onednn": PackedGemm, "onednn-fp32": PackedGemm,
              "kernel": KernelGemm, "amx": AmxGemm}


def runnable_gemms(dtype, weight, bias):
    """(path, Gemm) for every candidate path this machine can run."""
    gemms = []
    for path in candidate_paths(dtype):
        try:
            gemms.append((path, make_gemm(path, weight, bias)))
        except RuntimeError:        # e.g. oneDNN bf16 on a CPU without AVX-512
            continue
    return gemms


def random_norm(dim, dtype, gen):
    norm = RMSNorm(dim, 1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(dim, generator=gen) + 0.5)
    return norm


# -- gemm.py: the products ---------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_every_cpu_gemm_path_equals_f_linear(dtype, bias):
    """Each path this machine can run (oneDNN packed, packed float32 for bf16, gemm.c, torch)
    gives F.linear's numbers through `.product(x)`, within the dtype's rounding, for decode- and
    prefill-sized row counts."""
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(40, 96, generator=gen).to(dtype)
    b = torch.randn(40, generator=gen).to(dtype) if bias else None
    gemms = runnable_gemms(dtype, weight, b)
    for path, gemm in gemms:
        for rows in (1, 7, 64, 300):
            x = torch.randn(rows, 96, generator=gen).to(dtype)
            out = gemm.product(x)
            assert out.dtype == dtype and out.shape == (rows, 40), path
            exact = x.double() @ weight.double().t() + (b.double() if bias else 0)
            tol = dict(atol=1e-4, rtol=1e-5) if dtype == torch.float32 else dict(atol=0.05, rtol=2**-7)
            torch.testing.assert_close(out.double(), exact, **tol)
            torch.testing.assert_close(out, F.linear(x, weight, b), **tol)
    paths = [path for path, _ in gemms]
    assert len(paths) >= 2 or not torch.backends.mkldnn.is_available()
    assert "kernel" in paths or cpu_kernels.load() is None


@needs_kernels
def test_gemm_pack_writes_its_padding_as_zeros():
    """bf16 with an odd number of inputs: the last pair's second half, and the columns past the
    last output, are multiplied too (by zeros of x); packed into memory full of NaN (what an
    unwritten pad might hold: NaN x 0 is NaN), they must come out 0. This once made the odd-input
    bf16 tests fail now and then."""
    kernels, width = cpu_kernels.load(), cpu_kernels.load().gemm_panel_width()
    weight = torch.randn(5, 3).to(torch.bfloat16)
    packed = torch.full((width * 4,), float("nan"), dtype=torch.bfloat16)
    kernels.gemm_pack(weight.data_ptr(), packed.data_ptr(), 5, 3, 1)
    pairs = packed.view(2, width, 2)                   # [k / 2][column][k % 2]
    assert not packed.isnan().any()
    assert torch.equal(pairs[1, :, 1], torch.zeros(width, dtype=torch.bfloat16))   # k = 3: padding
    assert torch.equal(pairs[:, 5:], torch.zeros(2, width - 5, 2, dtype=torch.bfloat16))
    assert torch.equal(pairs[0, :5, 0], weight[:, 0]) and torch.equal(pairs[1, :5, 0], weight[:, 2])


def assert_bf16_product(out, x, weight, bias, ref):
    """Within one bf16 step of the exact product, and nearly always F.linear's very bits (both
    sum in float32 and round once)."""
    exact = x.double() @ weight.double().t() + bias.double()
    assert ((out.double() - exact).abs() <= exact.abs() * 2**-8 + 1e-6).all()
    assert (out == ref).float().mean() > 0.97


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 1), (100, 33), (97, 64)])
def test_gemm_kernel_equals_f_linear_on_ragged_shapes(dtype, shape):
    """csrc/gemm.c where its blocking has edges: outputs that fill no whole panel or leave a
    part-filled last one, an odd number of inputs (bf16 packs them in pairs), and row counts
    that leave a part-filled row tile (7, 300) or span several row blocks (300), with a bias.
    float32: F.linear's numbers to float32 rounding; bf16: assert_bf16_product."""
    out_features, in_features = shape
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(out_features, in_features, generator=gen).to(dtype)
    bias = torch.randn(out_features, generator=gen).to(dtype)
    gemm = make_gemm("kernel", weight, bias)
    assert isinstance(gemm, KernelGemm)
    for rows in (1, 7, 8, 64, 300):
        x = torch.randn(rows, in_features, generator=gen).to(dtype)
        out, ref = gemm.product(x), F.linear(x, weight, bias)
        assert out.dtype == dtype and out.shape == (rows, out_features)
        if dtype == torch.float32:
            torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
        else:
            assert_bf16_product(out, x, weight, bias, ref)


@needs_amx
@pytest.mark.parametrize("shape", [(17, 32), (40, 96), (100, 64)])
def test_gemm_amx_equals_f_linear_on_ragged_shapes(shape):
    """gemm.c's AMX loop where its tiles have edges: outputs that fill no whole block of 16 (17,
    40, 100: the last rows come from a zero-padded copy; 100 is 7 blocks, so a thread's passes of
    two end in one of one) and row counts that leave a part-filled row tile or an odd number of
    them (300: 19), with a bias. Forced to the loop for every row count; assert_bf16_product."""
    out_features, in_features = shape
    gen = torch.Generator().manual_seed(2)
    weight = torch.randn(out_features, in_features, generator=gen).to(torch.bfloat16)
    bias = torch.randn(out_features, generator=gen).to(torch.bfloat16)
    gemm = AmxGemm(weight, bias, loop_rows=1 << 30)
    for rows in (1, 7, 16, 64, 300):
        x = torch.randn(rows, in_features, generator=gen).to(torch.bfloat16)
        out, ref = gemm.product(x), F.linear(x, weight, bias)
        assert out.dtype == torch.bfloat16 and out.shape == (rows, out_features)
        assert_bf16_product(out, x, weight, bias, ref)
    above = AmxGemm(weight, bias, loop_rows=0)   # every row count to F.linear
    assert torch.equal(above.product(x), ref)


@needs_amx
def test_gemm_amx_refuses_what_it_cannot_multiply():
    with pytest.raises(RuntimeError):                  # inputs not a multiple of 32
        make_gemm("amx", torch.randn(16, 48).to(torch.bfloat16), None)
    with pytest.raises(RuntimeError):                  # float32: AMX multiplies bf16 only
        make_gemm("amx", torch.randn(16, 64), None)
    assert amx_loop_rows(64, 64) in (0, 8, 16, 32, 64, 128, 256, 512)


# -- gemm.py: choose_cpu_gemms on a model ------------------------------------------------------

def tiny_llama(tie=False, bias=False, dtype=torch.float32):
    """A random 2-layer Llama: qkv 64x128 (the LM head's shape too), o 64x64, gate_up 64x192,
    down 96x64."""
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      tie_word_embeddings=tie, attention_bias=bias, mlp_bias=bias,
                      architectures=["LlamaForCausalLM"])
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn_like(p) * 0.2 + (1.0 if "norm" in name else 0.0))
    return model.to(dtype)


def linears_of(model) -> dict[str, Linear]:
    return {name: m for name, m in model.named_modules() if isinstance(m, Linear)}


SMALL = dict(max_num_batched_tokens=64, max_num_seqs=8)   # timed at 1, 8, 64 rows: quick


def test_choose_cpu_gemms_gives_each_shape_one_timed_path():
    """Every Linear gets a gemm on the path timed for its shape (one label, one path, for all
    the Linears of a shape: the tied LM head shares qkv's), each path one this CPU offers, each
    product F.linear's on the layer's own weight."""
    model = tiny_llama(tie=True, bias=True)
    linears = linears_of(model)
    weights = {m: (m.weight.detach().clone(), m.bias) for m in linears.values()}
    gemms, labels = choose_cpu_gemms(model, Config(**SMALL))
    assert set(gemms) == set(linears.values())
    assert set(labels.values()) <= set(candidate_paths(torch.float32))
    expected_labels = set()
    gen = torch.Generator().manual_seed(0)
    for name, layer in linears.items():
        label = gemm_label(layer, torch.float32)
        expected_labels.add(label)
        gemm = gemms[layer]
        assert isinstance(gemm, PATH_CLASS[labels[label]]), name
        weight, bias = weights[layer]
        x = torch.randn(3, layer.in_features, generator=gen)
        torch.testing.assert_close(gemm.product(x), F.linear(x, weight, bias), atol=1e-4, rtol=1e-5)
    assert set(labels) == expected_labels
    assert "64x128 float32" in labels and len(labels) == 4      # qkv and the LM head: one shape
    # Choosing leaves the Linears as they were (bind is what hands their weights to the gemms).
    assert all(layer.weight is not None and layer.impl == layer.forward_native for layer in linears.values())
    assert model.lm_head.weight is model.model.embed_tokens.weight


@pytest.mark.parametrize("forced, expected", [
    ("torch", "torch"),
    pytest.param("kernel", "kernel", marks=needs_kernels),
    ("amx", "torch"),       # float32: no AMX path for it, so every layer keeps torch's
])
def test_forced_cpu_gemm_path(forced, expected):
    model = tiny_llama()
    gemms, labels = choose_cpu_gemms(model, Config(cpu_gemm=forced, **SMALL))
    assert set(labels.values()) == {expected}
    assert all(isinstance(gemm, PATH_CLASS[expected]) for gemm in gemms.values())
    assert len(gemms) == len(linears_of(model))


# -- backend.py: bind ------------------------------------------------------------------------

@needs_kernels
def test_bind_gives_every_op_its_cpu_form():
    from nanoserve.cpu.backend import bind
    from nanoserve.cpu.graphs import CpuGraph
    from nanoserve.graph_capture import GraphWrapper
    model = tiny_llama(tie=True)
    embedding = model.model.embed_tokens.weight
    backend = bind(model, Config(cpu_gemm="kernel", **SMALL))
    assert backend.name == "cpu" and isinstance(backend.forward, GraphWrapper)
    assert backend.forward.graph_type is CpuGraph and backend.capture == backend.forward.capture
    assert backend.cudagraph_capture_sizes == Config(**SMALL).cudagraph_capture_sizes
    assert bind(tiny_llama(), Config(enforce_eager=True, **SMALL)).forward.__class__ is type(model)
    assert backend.build_metadata.func is ops.CpuAttentionMetadata.of and backend.argmax is cpu_kernels.argmax
    assert backend.build_metadata.keywords == {"max_decode_query_len": 1}   # no speculation
    assert set(backend.gemm_paths.values()) == {"kernel"}
    kinds = set()
    for module in model.modules():
        if isinstance(module, Linear):
            assert module.weight is None and isinstance(module.impl.__self__, KernelGemm)
            assert module.impl.__func__ is KernelGemm.product
        elif isinstance(module, SiluAndMul):
            assert module.impl is ops.silu_and_mul
        elif isinstance(module, (RMSNorm, RopeStoreKV, Attention)):
            form = {RMSNorm: ops.rms_norm, RopeStoreKV: ops.rope_store_kv, Attention: ops.attention}
            assert isinstance(module.impl, functools.partial) and module.impl.args == (module,)
            assert module.impl.func is form[type(module)]
        else:
            continue
        kinds.add(type(module))
    assert kinds == {Linear, RMSNorm, SiluAndMul, RopeStoreKV, Attention}
    assert model.model.embed_tokens.weight is embedding     # the tied LM head gave up only its own


def test_without_the_kernels_the_model_keeps_its_torch_reference(monkeypatch):
    from nanoserve.backends import load_backend
    from nanoserve.cpu.backend import bind
    monkeypatch.setattr(cpu_kernels, "load", lambda: None)
    model = tiny_llama()
    assert bind(model, Config()) is None
    backend = load_backend(model, Config(), torch.device("cpu"))
    assert backend.name == "torch" and backend.forward is model
    assert set(backend.gemm_paths.values()) == {"torch"}
    for module in model.modules():
        if isinstance(module, (Linear, RMSNorm, SiluAndMul, RopeStoreKV, Attention)):
            assert module.impl == module.forward_native, module
        if isinstance(module, Linear):
            assert module.weight is not None


# -- ops.py: rms_norm, silu_and_mul, rope_store_kv ---------------------------------------------

@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 7, 300])
@pytest.mark.parametrize("dim", [576, 40])
def test_rms_norm_cpu_form_equals_forward_native(dtype, rows, dim):
    """ops.rms_norm (csrc/rms_norm.c) against RMSNorm.forward_native (HF's order of roundings),
    with and without the fused residual add, and the residual updated in place to the same bits
    (the very tensor given, returned). dim 40: the values past the last whole vector go one by
    one."""
    gen = torch.Generator().manual_seed(0)
    norm = random_norm(dim, dtype, gen)
    x = (3 * torch.randn(rows, dim, generator=gen)).to(dtype)
    residual = torch.randn(rows, dim, generator=gen).to(dtype)
    given, theirs = residual.clone(), residual.clone()
    with torch.inference_mode():
        cpu_plain = ops.rms_norm(norm, x)
        cpu_out, cpu_residual = ops.rms_norm(norm, x, given)
        raw = cpu_kernels.rms_norm(x, None, norm.weight, norm.eps)
        native_plain = norm.forward_native(x)
        native_out, native_residual = norm.forward_native(x, theirs)
    assert cpu_residual is given and native_residual is theirs
    assert torch.equal(cpu_residual, x + residual) and torch.equal(cpu_residual, native_residual)
    assert raw is not None and torch.equal(raw, cpu_plain)
    # bf16: the sum of squares is added in another order, so a value may land one bf16 step away.
    tol = dict(atol=1e-6, rtol=1e-6) if dtype == torch.float32 else dict(atol=0, rtol=2**-7)
    torch.testing.assert_close(cpu_plain, native_plain, **tol)
    torch.testing.assert_close(cpu_out, native_out, **tol)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_cpu_form_on_qwen3_head_views(dtype):
    """Qwen3's q and k norms: RMSNorm over each head of a view of qkv's columns ([tokens, heads,
    head_dim], tokens a whole qkv row apart). The CPU form copies the view contiguous, then
    rms_norm.c: == forward_native within the roundings above."""
    gen = torch.Generator().manual_seed(2)
    norm = random_norm(64, dtype, gen)
    qkv = (3 * torch.randn(13, 15 * 64, generator=gen)).to(dtype)
    for view in (qkv[:, :9 * 64].view(13, 9, 64), qkv[:, 9 * 64:12 * 64].view(13, 3, 64)):
        with torch.inference_mode():
            out, native = ops.rms_norm(norm, view), norm.forward_native(view)
        assert out.is_contiguous() and out.shape == view.shape
        tol = dict(atol=1e-6, rtol=1e-6) if dtype == torch.float32 else dict(atol=0, rtol=2**-7)
        torch.testing.assert_close(out, native, **tol)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 7, 300])
@pytest.mark.parametrize("intermediate", [1536, 20])
def test_silu_and_mul_cpu_form_equals_forward_native(dtype, rows, intermediate):
    """ops.silu_and_mul (csrc/silu_and_mul.c) against SiluAndMul.forward_native (HF's
    act_fn(gate) * up, with its roundings): float32 within an ulp or two (the C expf is not
    torch's); bf16 mostly to the bit, and where silu(gate) lands on a rounding edge one bf16 step
    away. intermediate 20: a row's last values go one by one. Then inside LlamaMLP: its act_fn set
    to the CPU form against the same MLP left native."""
    gen = torch.Generator().manual_seed(0)
    gate_up = (4 * torch.randn(rows, 2 * intermediate, generator=gen)).to(dtype)
    out, expected = ops.silu_and_mul(gate_up), NATIVE_SILU_AND_MUL(gate_up)
    assert out.is_contiguous() and out.shape == (rows, intermediate) and out.dtype == dtype
    assert torch.equal(out, cpu_kernels.silu_and_mul(gate_up))
    tol = dict(atol=1e-6, rtol=1e-6) if dtype == torch.float32 else dict(atol=0, rtol=2**-6)
    torch.testing.assert_close(out, expected, **tol)
    assert (out == expected).float().mean() > (0.4 if dtype == torch.float32 else 0.99)

    cfg = SimpleNamespace(hidden_act="silu", hidden_size=64, intermediate_size=intermediate)
    mlp = LlamaMLP(cfg, SINGLE).to(dtype)
    for w in (mlp.gate_up_proj.weight, mlp.down_proj.weight):
        w.data.copy_(torch.randn(w.shape, generator=gen) / 8)
    x = torch.randn(rows, 64, generator=gen).to(dtype)
    calls = []
    with torch.inference_mode():
        native = mlp(x)
        mlp.act_fn.impl = lambda gate_up: calls.append(gate_up.shape) or ops.silu_and_mul(gate_up)
        cpu = mlp(x)
    assert calls == [(rows, 2 * intermediate)]
    # down_proj sums `intermediate` products, each of whose silu may be an ulp off
    torch.testing.assert_close(cpu, native, **(dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32
                                               else dict(atol=2e-2, rtol=2e-2)))


@needs_kernels
def test_norm_and_silu_forms_fall_back_where_the_kernels_cannot_run():
    """float16 (no C kernel takes it) and a non-contiguous view: the raw kernels decline (None),
    and the CPU forms give the forward_native result, to the bit."""
    gen = torch.Generator().manual_seed(1)
    norm = random_norm(40, torch.float16, gen)
    for x in (torch.randn(7, 40, generator=gen).half(), torch.randn(40, 7, generator=gen).t()):
        norm_x = norm if x.dtype == torch.float16 else random_norm(40, torch.float32, gen)
        with torch.inference_mode():
            assert cpu_kernels.rms_norm(x, None, norm_x.weight, norm_x.eps) is None
            assert torch.equal(ops.rms_norm(norm_x, x), norm_x.forward_native(x))
            assert cpu_kernels.silu_and_mul(x) is None
            assert torch.equal(ops.silu_and_mul(x), NATIVE_SILU_AND_MUL(x))


HEADS, KV_HEADS, TOKENS = 9, 3, 13


def rope_step(dtype, head_dim, gen):
    """A fused qkv [tokens, (9 + 2 * 3) * head_dim], q, k, v as the model splits it (views), the
    step's rope at scattered positions, scattered slots."""
    qkv = torch.randn(TOKENS, (HEADS + 2 * KV_HEADS) * head_dim, generator=gen).to(dtype)
    sizes = [HEADS * head_dim, KV_HEADS * head_dim, KV_HEADS * head_dim]
    q, k, v = (t.view(TOKENS, h, head_dim) for t, h in zip(qkv.split(sizes, -1), (HEADS, KV_HEADS, KV_HEADS)))
    positions = torch.randint(0, 500, (TOKENS,), generator=gen)
    rope = RotaryEmbedding(head_dim, 512, {"rope_theta": 10000.0, "rope_type": "default"})(positions, dtype)
    slots = torch.randperm(40, generator=gen)[:TOKENS]
    return qkv, (q, k, v), rope, slots


def new_caches(dtype, head_dim):
    return tuple(torch.zeros(10, 4, KV_HEADS, head_dim, dtype=dtype) for _ in range(2))


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 40])
def test_rope_store_kv_cpu_form_equals_forward_native(dtype, head_dim, monkeypatch):
    """ops.rope_store_kv on the model's split views of one qkv tensor: fused_rows finds the qkv
    rows, and csrc/rope.c rotates q and k and stores k and v, against RopeStoreKV.forward_native
    (apply_rope on q and k, then store_kv_torch): bf16 to the bit (the same roundings); float32
    within an ulp (the compiler may fuse a product and a sum). head_dim 40: the pairs past the
    last whole vector go one by one."""
    gen = torch.Generator().manual_seed(0)
    qkv, (q, k, v), rope, slots = rope_step(dtype, head_dim, gen)
    rows = ops.fused_rows(q, k, v)
    assert rows is not None and rows.data_ptr() == qkv.data_ptr() and torch.equal(rows, qkv)
    op = RopeStoreKV()
    native_cache, cpu_cache, raw_cache = (new_caches(dtype, head_dim) for _ in range(3))
    q_native = op.forward_native(rope, q, k, v, native_cache, slots)
    q_raw = cpu_kernels.rope_store_kv(qkv, rope, slots, *raw_cache, HEADS)
    kernel, calls = cpu_kernels.rope_store_kv, []
    monkeypatch.setattr(cpu_kernels, "rope_store_kv", lambda *a: calls.append(1) or kernel(*a))
    q_cpu = ops.rope_store_kv(op, rope, q, k, v, cpu_cache, slots)
    assert calls == [1]                                       # the kernel ran, on the qkv rows
    assert q_cpu.shape == q.shape and torch.equal(q_cpu, q_raw)
    assert all(torch.equal(a, b) for a, b in zip(cpu_cache, raw_cache))
    tol = dict(atol=0, rtol=0) if dtype == torch.bfloat16 else dict(atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(q_cpu, q_native, **tol)
    torch.testing.assert_close(cpu_cache[0], native_cache[0], **tol)
    torch.testing.assert_close(cpu_cache[1], native_cache[1], atol=0, rtol=0)
    assert cpu_cache[0].abs().sum() > 0 and cpu_cache[1].abs().sum() > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_store_kv_puts_rows_side_by_side_where_q_k_v_are_not_the_qkv_rows(dtype):
    """fused_rows is None unless q, k, v are the three column blocks of one qkv tensor in order:
    after Qwen3's q/k norms (new tensors), in another order, from another tensor, with no tokens.
    ops.rope_store_kv then copies their rows side by side for the kernel: forward_native's result
    (to float32 rounding, as above), and the caches it writes."""
    head_dim, gen = 64, torch.Generator().manual_seed(1)
    qkv, (q, k, v), rope, slots = rope_step(dtype, head_dim, gen)
    q_norm, k_norm = RMSNorm(head_dim, 1e-6).to(dtype), RMSNorm(head_dim, 1e-6).to(dtype)
    normed = (q_norm(q), k_norm(k), v)
    assert ops.fused_rows(*normed) is None
    assert ops.fused_rows(q, v, k) is None                    # k and v swapped
    assert ops.fused_rows(q, k, v.clone()) is None            # v from another tensor
    assert ops.fused_rows(q[:0], k[:0], v[:0]) is None        # no tokens
    assert ops.fused_rows(q, k, v) is not None
    op = RopeStoreKV()
    tol = dict(atol=0, rtol=0) if dtype == torch.bfloat16 else dict(atol=1e-6, rtol=1e-6)
    for q_, k_, v_ in (normed, (q.clone(), k, v)):
        native_cache, cpu_cache = new_caches(dtype, head_dim), new_caches(dtype, head_dim)
        expected = op.forward_native(rope, q_, k_, v_, native_cache, slots)
        torch.testing.assert_close(ops.rope_store_kv(op, rope, q_, k_, v_, cpu_cache, slots), expected, **tol)
        for ours, native in zip(cpu_cache, native_cache):
            torch.testing.assert_close(ours, native, **tol)
    # the reference rotates as apply_rope does: a check that the caches above are not both empty
    cos, sin = rope
    assert torch.equal(native_cache[0].view(-1, KV_HEADS, head_dim)[slots], apply_rope(k, cos, sin))
