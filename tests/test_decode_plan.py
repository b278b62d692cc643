"""DecodePlan (models/decode_plan.py) against the model's own forward: the same decode step, the same
bits, in the output and in the KV cache it writes; and the steps it must leave to the model.

    pytest -q tests/test_decode_plan.py
"""

import pytest
import torch
from transformers import LlamaConfig, Qwen3Config

from nanoserve.cpu import kernels as cpu_kernels
from nanoserve.models import get_model_class
from nanoserve.models.decode_plan import DecodePlan
from nanoserve.models.linear import choose_cpu_gemms
from nanoserve.paged_attention import AttentionMetadata

# Inputs multiples of 32 and an intermediate size a multiple of 16, as the AMX product needs.
TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
BLOCK = 4
# Every product on gemm.c (kernel, amx) or on F.linear (torch: the plan calls the Linear itself).
PATHS = [(torch.float32, "kernel"), (torch.bfloat16, "kernel"), (torch.bfloat16, "amx"),
         (torch.float32, "torch"), (torch.bfloat16, "torch")]

pytestmark = pytest.mark.skipif(cpu_kernels.load() is None, reason="no C compiler here")


def make_model(dtype, path, cfg=None, bias=False):
    cfg = cfg or LlamaConfig(**TINY, attention_bias=bias, mlp_bias=bias, architectures=["LlamaForCausalLM"])
    torch.manual_seed(0)
    model = get_model_class(cfg)(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn_like(p) * 0.2 + (1.0 if "norm" in name else 0.0))
    model = model.to(dtype)
    choose_cpu_gemms(model.linears(512, 64), path, shared=frozenset({id(model.model.embed_tokens.weight)}))
    return model


def step(lengths: list[int], new: list[int]):
    """AttentionMetadata (and positions) for requests with `lengths` tokens cached before this step
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
        query_start_loc=torch.tensor(starts, dtype=torch.int32), max_query_len=max(new),
        max_seq_len=max(c + n for c, n in zip(lengths, new)))
    return torch.tensor(positions), md


def caches(model, dtype):
    cfg = model.config
    shape = (8 * 8, BLOCK, cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads)
    return [(torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)) for _ in range(cfg.num_hidden_layers)]


@pytest.mark.parametrize("dtype, path", PATHS)
@pytest.mark.parametrize("bias", [False, True])
def test_plan_equals_the_model_to_the_bit(dtype, path, bias):
    if path == "amx" and not cpu_kernels.gemm_amx_ready():
        pytest.skip("no AMX on this CPU")
    model = make_model(dtype, path, bias=bias)
    plan = DecodePlan.build(model)
    assert plan is not None
    prompts = [7, 13, 2, 21, 5]
    kv = caches(model, dtype)
    with torch.inference_mode():
        positions, md = step([0] * len(prompts), prompts)    # the prompts into the cache first
        ids = torch.randint(0, 128, (sum(prompts),), generator=torch.Generator().manual_seed(1))
        assert plan(ids, positions, kv, md) is None           # a prefill: the model's job
        model(ids, positions, kv, md)
        theirs = [(k.clone(), v.clone()) for k, v in kv]
        for t in range(3):                                     # three decode steps, each through both
            positions, md = step([n + t for n in prompts], [1] * len(prompts))
            ids = torch.randint(0, 128, (len(prompts),), generator=torch.Generator().manual_seed(2 + t))
            ours, expected = plan(ids, positions, kv, md), model(ids, positions, theirs, md)
            assert ours is not None and torch.equal(ours, expected), t
            for (k, v), (k2, v2) in zip(kv, theirs):
                assert torch.equal(k, k2) and torch.equal(v, v2)


def test_plan_leaves_the_model_what_it_cannot_run():
    qwen3 = Qwen3Config(**TINY, head_dim=16, architectures=["Qwen3ForCausalLM"])
    assert DecodePlan.build(make_model(torch.float32, "kernel", qwen3)) is None   # q/k norms
    assert DecodePlan.build(make_model(torch.float16, "torch")) is None       # no kernels for fp16


@pytest.mark.skipif(not cpu_kernels.gemm_amx_ready(), reason="no AMX on this CPU")
def test_plan_runs_rows_above_the_amx_loop_as_the_model_does():
    """A product whose AMX loop stops below the step's rows: F.linear, through its Linear."""
    model = make_model(torch.bfloat16, "amx")
    for layer in model.model.layers:
        layer.mlp.down_proj.gemm.loop_rows = 2
    plan, kv = DecodePlan.build(model), caches(model, torch.bfloat16)
    theirs = [(k.clone(), v.clone()) for k, v in kv]
    positions, md = step([4, 4, 4], [1, 1, 1])
    with torch.inference_mode():
        ids = torch.tensor([1, 2, 3])
        assert torch.equal(plan(ids, positions, kv, md), model(ids, positions, theirs, md))
