"""Oracle tests for models/: our Llama-family modules == HF transformers, logit for logit.

Each case builds a tiny random HF model in-process (float32, 2 layers), loads its state_dict into
ours through `load_weights`, and runs the same token sequences through both: HF as one plain
forward per sequence, ours through the paged cache in steps that split the sequences the way
the scheduler would (whole prefill, prefill in chunks, decodes batched with another prefill).
Every position's logits must agree, on the torch reference (the plain model: each op's
forward_native) and with the CPU backend bound (nanoserve/cpu/backend.py: the C kernels and the
products of gemm.c).

    pytest -q tests/test_models.py
"""

from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

from nanoserve.attention_metadata import AttentionMetadata
from nanoserve.config import Config
from nanoserve.cpu import kernels as cpu_kernels
from nanoserve.layers import Attention, Linear, RMSNorm
from nanoserve.models import LlamaForCausalLM, get_model_class
from nanoserve.models import get_head_size
from nanoserve.models.llama import rope_parameters

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
    """A minimal worker: scattered blocks per request, flat batches, AttentionMetadata.
    `backend`: a bound Backend (its forward and metadata, as the model runner calls them), or
    None for the plain model."""

    def __init__(self, model, cfg, num_blocks=48, block_size=4, backend=None):
        self.model, self.block_size, self.backend = model, block_size, backend
        shape = (num_blocks, block_size, cfg.num_key_value_heads, get_head_size(cfg))
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
        )
        ids, positions = torch.tensor(input_ids), torch.tensor(positions)
        if self.backend is None:
            hidden = self.model(ids, positions, self.kv_caches, md)
        else:
            hidden = self.backend.forward(ids, positions, self.kv_caches, self.backend.build_metadata(md))
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


needs_kernels = pytest.mark.skipif(cpu_kernels.load() is None, reason="no C compiler here")
# "torch": the plain model, every op on its forward_native. "cpu": the CPU backend bound with
# every product on gemm.c, each step run op by op (no capture here: replayed decode steps are
# tests/test_cpu_graphs.py's, and test_llm.py's through the engine).
BACKENDS = ["torch", pytest.param("cpu", marks=needs_kernels)]


def bind_backend(model, backend, monkeypatch):
    """The CPU backend bound to `model` (after load_weights: bind hands each Linear's weight to
    its gemm), or None for "torch"."""
    if backend == "torch":
        return None
    from nanoserve.cpu.backend import bind
    bound = bind(model, Config(cpu_gemm="kernel"))
    assert bound is not None and bound.name == "cpu"
    # Not the torch reference by accident: the products are gemm.c's.
    assert set(bound.gemm_paths.values()) == {"kernel"}
    return bound


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("name", CONFIGS)
def test_logits_match_hf(name, schedule, backend, monkeypatch):
    hf, model, cfg = make_models(name)
    steps = SCHEDULES[schedule]
    gen = torch.Generator().manual_seed(2)
    lengths = {req: sum(s.get(req, 0) for s in steps) for req in steps[0] | steps[-1]}
    seqs = {req: torch.randint(cfg.vocab_size, (n,), generator=gen).tolist() for req, n in lengths.items()}

    runner = PagedRunner(model, cfg, backend=bind_backend(model, backend, monkeypatch))
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


@pytest.mark.parametrize("backend", ["torch", pytest.param("cpu-unfused", marks=needs_kernels)])
def test_forward_hooks_fire_on_every_kind_of_op(backend, monkeypatch):
    """The model calls its ops as modules (layers.py), so a forward hook on a Linear, an RMSNorm,
    the Attention op or a decoder layer sees each call, on the torch reference and on the CPU
    backend's unfused forms alike. Prefill of 5 tokens; the hooked Linear's output must be its
    product of the input the hook saw."""
    _, model, cfg = make_models("llama")
    qkv_proj = model.model.layers[0].self_attn.qkv_proj
    weight, bias = qkv_proj.weight.detach().clone(), qkv_proj.bias   # bind hands the weight to its gemm
    bound = bind_backend(model, backend, monkeypatch)
    layer = model.model.layers[0]
    attn = layer.self_attn
    n, hidden = 5, cfg.hidden_size
    expected = {
        "linear": (attn.qkv_proj, (n, attn.q_size + 2 * attn.kv_size)),
        "rms_norm": (layer.input_layernorm, (n, hidden)),     # layer 0: no residual, one tensor
        "attention": (attn.attn, (n, attn.num_heads, attn.head_dim)),
        "decoder_layer": (layer, ((n, hidden), (n, hidden))),  # (MLP output, residual)
    }
    assert isinstance(attn.qkv_proj, Linear) and isinstance(layer.input_layernorm, RMSNorm)
    assert isinstance(attn.attn, Attention)
    calls = {name: [] for name in expected}
    for name, (module, _) in expected.items():
        module.register_forward_hook(lambda m, args, out, name=name: calls[name].append((args, out)))
    runner = PagedRunner(model, cfg, backend=bound)
    runner.step({"a": list(range(n))}, {"a": n})
    for name, (_, shape) in expected.items():
        assert len(calls[name]) == 1, name
        out = calls[name][0][1]
        got = tuple(t.shape for t in out) if isinstance(out, tuple) else out.shape
        assert got == shape, name
    (x,), qkv = calls["linear"][0]
    torch.testing.assert_close(qkv, torch.nn.functional.linear(x, weight, bias), atol=1e-5, rtol=1e-5)
