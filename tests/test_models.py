"""Oracle tests for models/: our Llama-family modules == HF transformers, logit for logit.

Each case builds a tiny random HF model in-process (float32, 2 layers), loads its state_dict into
ours through `load_weights`, and runs the same token sequences through both: HF as one plain
forward per sequence, ours through the paged cache in steps that split the sequences the way
the scheduler would (whole prefill, prefill in chunks, decodes batched with another prefill).
Every position's logits must agree.

    pytest -q tests/test_models.py
"""

from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

from nanoserve.models import LlamaForCausalLM, get_model_class
from nanoserve.cpu import kernels as cpu_kernels
from nanoserve.models import linear
from nanoserve.models.llama import head_dim_of, rope_parameters
from nanoserve.paged_attention import AttentionMetadata

TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
LLAMA3_ROPE = dict(rope_type="llama3", rope_theta=10000.0, factor=8.0, low_freq_factor=1.0,
                   high_freq_factor=4.0, original_max_position_embeddings=32)

CONFIGS = {
    "llama": lambda: LlamaConfig(**TINY, tie_word_embeddings=False),
    # head_dim 16, original context 32: one frequency kept, two interpolated, the rest divided.
    "llama3-rope-tied": lambda: LlamaConfig(**TINY, tie_word_embeddings=True, rope_parameters=LLAMA3_ROPE),
    "llama-linear-rope-bias": lambda: LlamaConfig(
        **TINY, attention_bias=True, mlp_bias=True,
        rope_parameters=dict(rope_type="linear", rope_theta=500.0, factor=2.0)),
    "mistral": lambda: MistralConfig(**TINY, sliding_window=None),
    "qwen2-tied": lambda: Qwen2Config(**TINY, tie_word_embeddings=True),
    "qwen3-head-dim": lambda: Qwen3Config(**TINY, head_dim=32, tie_word_embeddings=False),
}
ARCH = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
        "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}


def make_models(name):
    cfg = CONFIGS[name]()
    cfg.architectures = [ARCH[cfg.model_type]]
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    # HF's init leaves norms at 1 and biases at 0: randomise everything so a weight that loads
    # into the wrong place (or not at all) changes the logits.
    with torch.no_grad():
        for pname, p in hf.named_parameters():
            p.copy_(torch.randn_like(p) * 0.1 + (1.0 if "norm" in pname else 0.0))
    model = get_model_class(cfg)(cfg).eval()
    model.load_weights(hf.state_dict().items())
    return hf, model, cfg


class PagedRunner:
    """A minimal worker: scattered blocks per request, flat batches, AttentionMetadata."""

    def __init__(self, model, cfg, num_blocks=48, block_size=4):
        self.model, self.block_size = model, block_size
        shape = (num_blocks, block_size, cfg.num_key_value_heads, head_dim_of(cfg))
        self.kv_caches = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(cfg.num_hidden_layers)]
        self.free_blocks = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(1)).tolist()
        self.block_tables: dict[str, list[int]] = {}
        self.num_computed: dict[str, int] = {}

    @torch.no_grad()
    def step(self, seqs: dict[str, list[int]], scheduled: dict[str, int]) -> dict[str, torch.Tensor]:
        """Run `scheduled[req]` new tokens of each request; return each one's logits [n, vocab]."""
        input_ids, positions, slots, qsl, seq_lens = [], [], [], [0], []
        for req, n in scheduled.items():
            start = self.num_computed.get(req, 0)
            table = self.block_tables.setdefault(req, [])
            while len(table) * self.block_size < start + n:
                table.append(self.free_blocks.pop())
            for pos in range(start, start + n):
                slots.append(table[pos // self.block_size] * self.block_size + pos % self.block_size)
            input_ids += seqs[req][start:start + n]
            positions += range(start, start + n)
            qsl.append(qsl[-1] + n)
            seq_lens.append(start + n)
            self.num_computed[req] = start + n
        tables = [self.block_tables[r] for r in scheduled]
        width = max(len(t) for t in tables)
        md = AttentionMetadata(
            slot_mapping=torch.tensor(slots),
            block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            query_start_loc=torch.tensor(qsl, dtype=torch.int32),
            max_query_len=max(scheduled.values()),
            max_seq_len=max(seq_lens),
        )
        hidden = self.model(torch.tensor(input_ids), torch.tensor(positions), self.kv_caches, md)
        logits = self.model.compute_logits(hidden)
        assert logits.dtype == hidden.dtype   # the model's: the sampler widens where it needs
        return {req: logits[qsl[i]:qsl[i + 1]] for i, req in enumerate(scheduled)}


SCHEDULES = {
    "prefill": [{"a": 13}],
    "chunked-prefill": [{"a": 6}, {"a": 7}],  # the prefix is read back from the cache
    # a decodes while b prefills in chunks beside it and c arrives: one flat batch per step
    "decode-with-prefill": [{"a": 9}, {"a": 1, "b": 6}, {"a": 1, "b": 5}, {"a": 1, "b": 1, "c": 4},
                            {"a": 1, "b": 1, "c": 1}],
}


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("name", CONFIGS)
def test_logits_match_hf(name, schedule):
    hf, model, cfg = make_models(name)
    steps = SCHEDULES[schedule]
    gen = torch.Generator().manual_seed(2)
    lengths = {req: sum(s.get(req, 0) for s in steps) for req in steps[0] | steps[-1]}
    seqs = {req: torch.randint(cfg.vocab_size, (n,), generator=gen).tolist() for req, n in lengths.items()}

    runner = PagedRunner(model, cfg)
    ours: dict[str, list[torch.Tensor]] = {req: [] for req in seqs}
    for scheduled in steps:
        for req, logits in runner.step(seqs, scheduled).items():
            ours[req].append(logits)

    for req, tokens in seqs.items():
        with torch.no_grad():
            expected = hf(input_ids=torch.tensor([tokens])).logits[0]
        torch.testing.assert_close(torch.cat(ours[req]), expected, atol=1e-4, rtol=1e-4)


def test_load_weights_errors_name_the_weight():
    hf, model, cfg = make_models("qwen2-tied")
    weights = dict(hf.state_dict())
    weights["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)  # old checkpoints: ignored
    model.load_weights(weights.items())

    without = {k: v for k, v in weights.items() if k != "model.layers.1.self_attn.k_proj.bias"}
    with pytest.raises(ValueError, match=r"missing.*model\.layers\.1\.self_attn\.k_proj\.bias"):
        model.load_weights(without.items())
    with pytest.raises(ValueError, match="unexpected weight 'model.layers.9.mlp.up_proj.weight'"):
        model.load_weights([*weights.items(), ("model.layers.9.mlp.up_proj.weight", torch.ones(1))])
    bad_shape = {**weights, "model.norm.weight": torch.ones(3)}
    with pytest.raises(ValueError, match="model.norm.weight"):
        model.load_weights(bad_shape.items())


def test_tied_lm_head_shares_the_embedding():
    _, tied, _ = make_models("qwen2-tied")
    _, untied, _ = make_models("llama")
    assert tied.lm_head.weight is tied.model.embed_tokens.weight
    assert untied.lm_head.weight is not untied.model.embed_tokens.weight


def test_sliding_window_is_reported():
    assert LlamaForCausalLM(MistralConfig(**TINY, sliding_window=64)).sliding_window == 64
    assert LlamaForCausalLM(LlamaConfig(**TINY)).sliding_window is None
    assert LlamaForCausalLM(Qwen2Config(**TINY, sliding_window=64)).sliding_window is None  # off by default


def test_unknown_architecture_lists_supported():
    cfg = LlamaConfig(**TINY, architectures=["GPT2LMHeadModel"])
    with pytest.raises(ValueError, match="GPT2LMHeadModel") as err:
        get_model_class(cfg)
    for arch in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        assert arch in str(err.value)


def test_unsupported_rope_type():
    cfg = LlamaConfig(**TINY, rope_parameters=dict(rope_type="dynamic", rope_theta=10000.0, factor=2.0))
    with pytest.raises(ValueError, match="rope_type 'dynamic'"):
        LlamaForCausalLM(cfg)


def test_rope_parameters_from_transformers_4_configs():
    # transformers 4 kept rope_theta beside an optional rope_scaling dict (type key once `type`).
    old = SimpleNamespace(rope_theta=5e5, rope_scaling={"type": "linear", "factor": 2.0})
    assert rope_parameters(old) == {"rope_theta": 5e5, "type": "linear", "factor": 2.0, "rope_type": "linear"}
    plain = SimpleNamespace(rope_theta=1e6, rope_scaling=None)
    assert rope_parameters(plain) == {"rope_theta": 1e6, "rope_type": "default"}
    assert rope_parameters(LlamaConfig(**TINY, rope_theta=1e6))["rope_theta"] == 1e6  # transformers 5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_every_cpu_gemm_path_equals_f_linear(dtype, bias):
    """Each path this machine can run (oneDNN packed, packed float32 for bf16, torch) gives
    F.linear's numbers, within the dtype's rounding, for decode- and prefill-sized row counts."""
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(40, 96, generator=gen).to(dtype)
    b = torch.randn(40, generator=gen).to(dtype) if bias else None
    runnable = 0
    for path in linear.candidate_paths(dtype):
        try:
            gemm = linear.make_gemm(path, weight, b)
        except RuntimeError:        # e.g. oneDNN bf16 on a CPU without AVX-512
            continue
        runnable += 1
        for rows in (1, 7, 64, 300):
            x = torch.randn(rows, 96, generator=gen).to(dtype)
            out = gemm(x)
            assert out.dtype == dtype and out.shape == (rows, 40)
            exact = x.double() @ weight.double().t() + (b.double() if bias else 0)
            tol = dict(atol=1e-4, rtol=1e-5) if dtype == torch.float32 else dict(atol=0.05, rtol=2**-7)
            torch.testing.assert_close(out.double(), exact, **tol)
            torch.testing.assert_close(out, torch.nn.functional.linear(x, weight, b), **tol)
    assert runnable >= 2 or not torch.backends.mkldnn.is_available()


@pytest.mark.skipif(cpu_kernels.load() is None, reason="no C compiler here")
def test_gemm_pack_writes_its_padding_as_zeros():
    """bf16 with an odd number of inputs: the last pair's second half, and the columns past the
    last output, are multiplied too (by zeros of x); packed into memory full of NaN (what an
    unwritten pad might hold: NaN x 0 is NaN), they must come out 0. This once made the two
    odd-input bf16 tests below fail now and then."""
    kernels, width = cpu_kernels.load(), cpu_kernels.load().gemm_panel_width()
    weight = torch.randn(5, 3).to(torch.bfloat16)
    packed = torch.full((width * 4,), float("nan"), dtype=torch.bfloat16)
    kernels.gemm_pack(weight.data_ptr(), packed.data_ptr(), 5, 3, 1)
    pairs = packed.view(2, width, 2)                   # [k / 2][column][k % 2]
    assert not packed.isnan().any()
    assert torch.equal(pairs[1, :, 1], torch.zeros(width, dtype=torch.bfloat16))   # k = 3: padding
    assert torch.equal(pairs[:, 5:], torch.zeros(2, width - 5, 2, dtype=torch.bfloat16))
    assert torch.equal(pairs[0, :5, 0], weight[:, 0]) and torch.equal(pairs[1, :5, 0], weight[:, 2])


@pytest.mark.skipif(cpu_kernels.load() is None, reason="no C compiler here")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 1), (100, 33), (97, 64)])
def test_gemm_kernel_equals_f_linear_on_ragged_shapes(dtype, shape):
    """csrc/gemm.c where its blocking has edges: outputs that fill no whole panel or leave a
    part-filled last one, an odd number of inputs (bf16 packs them in pairs), and row counts
    that leave a part-filled row tile (7, 300) or span several row blocks (300), with a bias.
    float32: F.linear's numbers to float32 rounding. bf16: within one bf16 step of the exact
    product, and nearly always F.linear's very bits (both sum in float32 and round once)."""
    out_features, in_features = shape
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(out_features, in_features, generator=gen).to(dtype)
    bias = torch.randn(out_features, generator=gen).to(dtype)
    gemm = linear.make_gemm("kernel", weight, bias)
    for rows in (1, 7, 8, 64, 300):
        x = torch.randn(rows, in_features, generator=gen).to(dtype)
        out, ref = gemm(x), torch.nn.functional.linear(x, weight, bias)
        assert out.dtype == dtype and out.shape == (rows, out_features)
        if dtype == torch.float32:
            torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
            continue
        exact = x.double() @ weight.double().t() + bias.double()
        assert ((out.double() - exact).abs() <= exact.abs() * 2**-8 + 1e-6).all()
        assert (out == ref).float().mean() > 0.97


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("intermediate, in_features", [(1, 33), (20, 64), (24, 33), (50, 64), (96, 96)])
def test_every_cpu_gemm_path_with_silu_and_mul_equals_torch(dtype, intermediate, in_features):
    """A gate_up Linear's silu(gate) * up on every path this machine runs, against F.linear then
    HF's act_fn(gate) * up in torch. gemm.c applies it to its tiles, whose panels hold half gate
    and half up columns (csrc/gemm.c's panel is 48 or 24 columns): intermediate sizes that fill
    no panel, exactly one, or leave a part-filled one, with a bias and row counts that leave
    part-filled row tiles. float32 within float32 rounding (sums in another order, the C exp is
    not torch's); bf16 nearly always to the bit, else one bf16 step (a product or a silu on a
    rounding edge)."""
    gen = torch.Generator().manual_seed(2)
    weight = (torch.randn(2 * intermediate, in_features, generator=gen) / 4).to(dtype)
    bias = torch.randn(2 * intermediate, generator=gen).to(dtype)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=0, rtol=2**-6)
    for path in linear.candidate_paths(dtype):
        try:
            gemm = linear.make_gemm(path, weight, bias, silu_and_mul=True)
        except RuntimeError:        # e.g. oneDNN bf16 on a CPU without AVX-512
            continue
        same = []
        for rows in (1, 7, 64, 300):
            x = torch.randn(rows, in_features, generator=gen).to(dtype)
            gate, up = torch.nn.functional.linear(x, weight, bias).chunk(2, dim=-1)
            expected, out = torch.nn.functional.silu(gate) * up, gemm(x)
            assert out.dtype == dtype and out.shape == (rows, intermediate) and out.is_contiguous(), path
            torch.testing.assert_close(out, expected, **tol, msg=lambda m: f"{path}, {rows} rows: {m}")
            same.append((out == expected).flatten())
        # Over all row counts: a single row of 24 values has too few for a fraction.
        assert dtype == torch.float32 or torch.cat(same).float().mean() > 0.95, path


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_residual", [False, True])
def test_every_cpu_gemm_path_with_norm_equals_norm_then_product(dtype, with_residual):
    """Linear's `norm`: the product of RMSNorm(x + residual) on every path this machine runs
    (gemm.c normalises the rows as it copies them), against the norm and then F.linear, with the
    residual updated in place to the same bits. in_features 97: a row's last values go one by one,
    and bf16 pairs an odd count."""
    from nanoserve.models import llama
    gen = torch.Generator().manual_seed(3)
    norm = llama.RMSNorm(97, 1e-5).to(dtype)
    layer = linear.Linear(97, 40, bias=True).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(97, generator=gen) + 0.5)
        layer.weight.copy_(torch.randn(40, 97, generator=gen) / 8)
        layer.bias.copy_(torch.randn(40, generator=gen))
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=0.05, rtol=2**-7)
    for path in linear.candidate_paths(dtype):
        try:
            layer.use_gemm(path, keep_weight=True)
        except RuntimeError:        # e.g. oneDNN bf16 on a CPU without AVX-512
            continue
        for rows in (1, 7, 64, 300):
            x = (3 * torch.randn(rows, 97, generator=gen)).to(dtype)
            residual = torch.randn(rows, 97, generator=gen).to(dtype) if with_residual else None
            theirs = None if residual is None else residual.clone()
            with torch.inference_mode():
                out = layer(x, norm, residual)
                normed = norm(x) if theirs is None else norm(x, theirs)[0]
                expected = torch.nn.functional.linear(normed, layer.weight, layer.bias)
            torch.testing.assert_close(out, expected, **tol, msg=lambda m: f"{path}, {rows} rows: {m}")
            assert residual is None or torch.equal(residual, theirs), path


@pytest.mark.skipif(not cpu_kernels.gemm_amx_ready(), reason="no AMX on this CPU")
@pytest.mark.parametrize("shape", [(17, 32), (40, 96), (100, 64)])
def test_gemm_amx_equals_f_linear_on_ragged_shapes(shape):
    """gemm.c's AMX loop where its tiles have edges: outputs that fill no whole block of 16 (17,
    40, 100: the last rows come from a zero-padded copy; 100 is 7 blocks, so a thread's passes of
    two end in one of one) and row counts that leave a part-filled row tile or an odd number of
    them (300: 19), with a bias. Forced to the loop for every row
    count; within one bf16 step of the exact product, and nearly always F.linear's bits."""
    out_features, in_features = shape
    gen = torch.Generator().manual_seed(2)
    weight = torch.randn(out_features, in_features, generator=gen).to(torch.bfloat16)
    bias = torch.randn(out_features, generator=gen).to(torch.bfloat16)
    gemm = linear.AmxGemm(weight, bias, loop_rows=1 << 30)
    for rows in (1, 7, 16, 64, 300):
        x = torch.randn(rows, in_features, generator=gen).to(torch.bfloat16)
        out, ref = gemm(x), torch.nn.functional.linear(x, weight, bias)
        assert out.dtype == torch.bfloat16 and out.shape == (rows, out_features)
        exact = x.double() @ weight.double().t() + bias.double()
        assert ((out.double() - exact).abs() <= exact.abs() * 2**-8 + 1e-6).all()
        assert (out == ref).float().mean() > 0.97
    above = linear.AmxGemm(weight, bias, loop_rows=0)   # every row count to F.linear
    assert torch.equal(above(x), ref)


@pytest.mark.skipif(not cpu_kernels.gemm_amx_ready(), reason="no AMX on this CPU")
@pytest.mark.parametrize("intermediate", [48, 40])
def test_gemm_amx_silu_and_mul_equals_product_then_silu(intermediate):
    """gate_up on the AMX loop with silu_and_mul (silu(gate) * up from each pair of gate and up sum
    tiles) against the loop's gate_up product, stored in bf16, and then silu_and_mul: the same bits,
    since the pair is rounded as the product's store rounds it. Rows as the test above; 40: no
    whole number of blocks of 16, so the loop refuses and F.linear, then silu_and_mul, run instead."""
    gen = torch.Generator().manual_seed(5)
    weight = (torch.randn(2 * intermediate, 96, generator=gen) / 8).to(torch.bfloat16)
    bias = torch.randn(2 * intermediate, generator=gen).to(torch.bfloat16)
    fused = linear.AmxGemm(weight, bias, loop_rows=1 << 30, silu_and_mul=True)
    product = linear.AmxGemm(weight, bias, loop_rows=1 << 30)
    for rows in (1, 7, 16, 17, 64, 300):
        x = (3 * torch.randn(rows, 96, generator=gen)).to(torch.bfloat16)
        out, expected = fused(x), linear.apply_silu_and_mul(product(x))
        assert out.shape == (rows, intermediate)
        if intermediate % 16 == 0:
            assert torch.equal(out, expected), rows
        else:
            torch.testing.assert_close(out, expected, atol=0.05, rtol=2**-6)


@pytest.mark.skipif(not cpu_kernels.gemm_amx_ready(), reason="no AMX on this CPU")
@pytest.mark.parametrize("with_residual", [False, True])
def test_gemm_amx_with_norm_equals_norm_then_f_linear(with_residual):
    """The AMX loop's `norm` (its rows normalised as they are copied, the residual updated in
    place), and F.linear's above the loop's row count (normalised first): against the norm, then
    F.linear, the residual to the same bits. 100 outputs, 96 inputs: the test above's edges."""
    from nanoserve.models import llama
    gen = torch.Generator().manual_seed(4)
    norm = llama.RMSNorm(96, 1e-5).to(torch.bfloat16)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(96, generator=gen) + 0.5)
    weight = (torch.randn(100, 96, generator=gen) / 8).to(torch.bfloat16)
    bias = torch.randn(100, generator=gen).to(torch.bfloat16)
    for loop_rows in (1 << 30, 0):
        gemm = linear.AmxGemm(weight, bias, loop_rows=loop_rows)
        for rows in (1, 7, 16, 64, 300):
            x = (3 * torch.randn(rows, 96, generator=gen)).to(torch.bfloat16)
            residual = torch.randn(rows, 96, generator=gen).to(torch.bfloat16) if with_residual else None
            theirs = None if residual is None else residual.clone()
            with torch.inference_mode():
                out = gemm(x, norm, residual)
                normed = norm(x) if theirs is None else norm(x, theirs)[0]
                expected = torch.nn.functional.linear(normed, weight, bias)
            torch.testing.assert_close(out, expected, atol=0.05, rtol=2**-7)
            assert residual is None or torch.equal(residual, theirs)
    # A gate_up's AMX product hands its norm on too (silu * up after it).
    gate_up = linear.make_gemm("amx", weight[:96], bias[:96], silu_and_mul=True)
    x = (3 * torch.randn(7, 96, generator=gen)).to(torch.bfloat16)
    gate, up = torch.nn.functional.linear(norm(x), weight[:96], bias[:96]).chunk(2, dim=-1)
    torch.testing.assert_close(gate_up(x, norm), torch.nn.functional.silu(gate) * up, atol=0.05, rtol=2**-6)


@pytest.mark.skipif(not cpu_kernels.gemm_amx_ready(), reason="no AMX on this CPU")
def test_gemm_amx_refuses_what_it_cannot_multiply():
    with pytest.raises(RuntimeError):                  # inputs not a multiple of 32
        linear.make_gemm("amx", torch.randn(16, 48).to(torch.bfloat16), None)
    with pytest.raises(RuntimeError):                  # float32: AMX multiplies bf16 only
        linear.make_gemm("amx", torch.randn(16, 64), None)
    assert linear.amx_loop_rows(64, 64) in (0, 8, 16, 32, 64, 128, 256, 512)
    assert linear.amx_loop_rows(64, 64, silu_and_mul=True) in (0, 8, 16, 32, 64, 128, 256, 512)


def test_choose_cpu_gemms_packs_once_per_shape_and_keeps_shared_weights():
    layers = [linear.Linear(32, 48, bias=False) for _ in range(3)] + [linear.Linear(48, 32, bias=True)]
    for layer in layers:
        torch.nn.init.normal_(layer.weight)
    x = torch.randn(5, 32)
    expected = layers[0](x)
    shared = layers[1].weight
    chosen = linear.choose_cpu_gemms([(layer, [1, 8]) for layer in layers],
                                     shared=frozenset({id(shared)}))
    assert set(chosen) == {"32x48 float32", "48x32 float32"}
    assert all(path in linear.candidate_paths(torch.float32) for path in chosen.values())
    torch.testing.assert_close(layers[0](x), expected, atol=1e-4, rtol=1e-5)
    assert layers[1].weight is shared                  # a shared (tied) weight is never dropped
    packed = chosen["32x48 float32"] != "torch"
    assert (layers[0].weight is None) == packed         # a packed copy replaces the weight


def test_forced_cpu_gemm_path():
    layer = linear.Linear(16, 8, bias=False)
    chosen = linear.choose_cpu_gemms([(layer, [1])], forced="torch")
    assert chosen == {"16x8 float32": "torch"} and layer.gemm is None and layer.weight is not None


@pytest.mark.skipif(cpu_kernels.load() is None, reason="no C compiler here")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 7, 300])
@pytest.mark.parametrize("dim", [576, 40])
def test_rms_norm_kernel_equals_torch(dtype, rows, dim, monkeypatch):
    """The C RMSNorm (csrc/rms_norm.c) against the torch code it replaces (HF's order of roundings),
    with and without the fused residual add, and the residual updated in place. dim 40: the
    values past the last whole vector go one by one."""
    from nanoserve.models import llama
    gen = torch.Generator().manual_seed(0)
    norm = llama.RMSNorm(dim, 1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(dim, generator=gen) + 0.5)
    x = (3 * torch.randn(rows, dim, generator=gen)).to(dtype)
    residual = torch.randn(rows, dim, generator=gen).to(dtype)
    with torch.inference_mode():
        kernel_plain = norm(x)
        kernel_out, kernel_residual = norm(x, residual.clone())
        monkeypatch.setattr(cpu_kernels, "rms_norm", lambda *args: None)   # the torch path
        torch_plain = norm(x)
        torch_out, torch_residual = norm(x, residual.clone())
    # bf16: the sum of squares is added in another order, so a value may land one bf16 step away.
    tol = dict(atol=1e-6, rtol=1e-6) if dtype == torch.float32 else dict(atol=0, rtol=2**-7)
    torch.testing.assert_close(kernel_residual, x + residual, atol=0, rtol=0)
    given = residual.clone()                        # both paths update the residual in place
    assert norm(x, given)[1] is given and torch.equal(given, torch_residual)
    torch.testing.assert_close(kernel_residual, torch_residual, atol=0, rtol=0)
    torch.testing.assert_close(kernel_plain, torch_plain, **tol)
    torch.testing.assert_close(kernel_out, torch_out, **tol)


@pytest.mark.skipif(cpu_kernels.load() is None, reason="no C compiler here")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 7, 300])
@pytest.mark.parametrize("intermediate", [1536, 20])
def test_silu_and_mul_kernel_equals_torch(dtype, rows, intermediate, monkeypatch):
    """csrc/silu_and_mul.c through LlamaMLP against the torch code it replaces (HF's
    act_fn(gate) * up, with its roundings): float32 within an ulp or two (the C expf is not
    torch's); bf16 mostly to the bit, and where silu(gate) lands on a rounding edge one bf16 step
    away, which the product's own rounding can make two. intermediate 20: a row's last values go
    one by one."""
    from nanoserve.models import llama
    gen = torch.Generator().manual_seed(0)
    gate_up = (4 * torch.randn(rows, 2 * intermediate, generator=gen)).to(dtype)
    kernel = cpu_kernels.silu_and_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    expected = torch.nn.functional.silu(gate) * up
    assert kernel.is_contiguous() and kernel.shape == (rows, intermediate)
    tol = dict(atol=1e-6, rtol=1e-6) if dtype == torch.float32 else dict(atol=0, rtol=2**-6)
    torch.testing.assert_close(kernel, expected, **tol)
    assert (kernel == expected).float().mean() > (0.4 if dtype == torch.float32 else 0.99)
    # And inside the MLP: the kernel's path equals the torch fallback's.
    cfg = SimpleNamespace(hidden_act="silu", hidden_size=64, intermediate_size=96)
    mlp = llama.LlamaMLP(cfg, llama.SINGLE).to(dtype)
    for w in (mlp.gate_up_proj.weight, mlp.down_proj.weight):
        w.data.copy_(torch.randn(w.shape, generator=gen) / 8)
    x = torch.randn(rows, 64, generator=gen).to(dtype)
    with torch.inference_mode():
        with_kernel = mlp(x)
        monkeypatch.setattr(cpu_kernels, "silu_and_mul", lambda gate_up: None)
        with_torch = mlp(x)
    torch.testing.assert_close(with_kernel, with_torch, **(tol if dtype == torch.float32
                                                            else dict(atol=2e-2, rtol=2e-2)))


@pytest.mark.skipif(cpu_kernels.load() is None, reason="no C compiler here")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 40])
def test_rope_store_kv_kernel_equals_torch(dtype, head_dim):
    """csrc/rope.c against what it replaces: apply_rope on q and k, then store_kv, on a fused qkv
    row of 9 query and 3 KV heads at scattered positions and slots. bf16 to the bit (the same
    roundings); float32 within an ulp (the compiler may fuse a product and a sum). head_dim 40:
    the pairs past the last whole vector go one by one."""
    from nanoserve.models.llama import RotaryEmbedding, apply_rope
    from nanoserve.paged_attention import store_kv_torch
    gen = torch.Generator().manual_seed(0)
    heads, kv_heads, tokens = 9, 3, 13
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen).to(dtype)
    positions = torch.randint(0, 500, (tokens,), generator=gen)
    slots = torch.randperm(40, generator=gen)[:tokens]
    rope = RotaryEmbedding(head_dim, 512, {"rope_theta": 10000.0, "rope_type": "default"})(positions, dtype)
    caches = [torch.zeros(10, 4, kv_heads, head_dim, dtype=dtype) for _ in range(4)]
    q = cpu_kernels.rope_store_kv(qkv, rope, slots, caches[0], caches[1], heads)
    q_ref, k_ref, v_ref = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], -1)
    q_ref = apply_rope(q_ref.reshape(tokens, heads, head_dim), rope)
    k_ref = apply_rope(k_ref.reshape(tokens, kv_heads, head_dim), rope)
    store_kv_torch(k_ref, v_ref.reshape(tokens, kv_heads, head_dim), caches[2], caches[3], slots)
    tol = dict(atol=0, rtol=0) if dtype == torch.bfloat16 else dict(atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(q, q_ref, **tol)
    torch.testing.assert_close(caches[0], caches[2], **tol)
    torch.testing.assert_close(caches[1], caches[3], atol=0, rtol=0)
