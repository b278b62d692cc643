"""Capture and replay on the CPU (cpu/graphs.py): a replayed decode step equals the same step run
eagerly, to the bit, in its output and in the KV cache it writes, on every product path, with and
without biases; what is recorded is the model's own forward, op for op; a replay allocates
nothing and its memory is shared; a step that reads values is refused; and the engine with capture
gives the tokens it gives with --enforce-eager, with mixed and speculative steps eager.

    pytest -q tests/test_cpu_graphs.py
"""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import LlamaConfig, Qwen3Config

from nanoserve import LLM, SamplingParams
from nanoserve.config import Config
from nanoserve.cpu import graphs as cpu_graphs
from nanoserve.cpu import kernels as cpu_kernels
from nanoserve.cpu.backend import bind
from nanoserve.models import get_model_class
from nanoserve.step_inputs import StepInputs, padded_batch_size

pytestmark = pytest.mark.skipif(cpu_kernels.load() is None, reason="no C compiler here")

TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
BLOCK, SIZES = 4, [1, 2, 4, 8]
# Every product on gemm.c (kernel, amx) or on another path (F.linear, oneDNN: torch ops recorded).
PATHS = [(torch.float32, "kernel"), (torch.bfloat16, "kernel"), (torch.bfloat16, "amx"),
         (torch.float32, "torch"), (torch.bfloat16, "onednn")]
# (cached, new) per request, step by step: prefills, a mixed step, then decodes of 5 requests (padded
# to 8: replayed), and of 3 after two finished (padded to 4).
STEPS = [([0, 0, 0, 0], [7, 13, 2, 21]), ([7, 13, 2, 21, 0], [1, 1, 1, 1, 5])] + [
    ([8 + t, 14 + t, 3 + t, 22 + t, 5 + t], [1] * 5) for t in range(3)] + [([11, 17, 25], [1, 1, 1])]


def make_model(dtype, cfg=None, bias=False):
    cfg = cfg or LlamaConfig(**TINY, attention_bias=bias, mlp_bias=bias, architectures=["LlamaForCausalLM"])
    torch.manual_seed(0)
    model = get_model_class(cfg)(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn_like(p) * 0.2 + (1.0 if "norm" in name else 0.0))
    return model.to(dtype)


def step(lengths: list[int], new: list[int]):
    """The host tensors of a step: request i's blocks are 8 * i, 8 * i + 1, ... (room for 32)."""
    tables = [[8 * i + b for b in range(-(-(c + n) // BLOCK))] for i, (c, n) in enumerate(zip(lengths, new))]
    positions = [p for c, n in zip(lengths, new) for p in range(c, c + n)]
    slots = [tables[i][p // BLOCK] * BLOCK + p % BLOCK
             for i, (c, n) in enumerate(zip(lengths, new)) for p in range(c, c + n)]
    width, starts = max(map(len, tables)), [0]
    for n in new:
        starts.append(starts[-1] + n)
    return dict(positions=torch.tensor(positions), slot_mapping=torch.tensor(slots),
                seq_lens=torch.tensor([c + n for c, n in zip(lengths, new)]),
                query_start_loc=torch.tensor(starts),
                block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
                logits_indices=torch.tensor(starts[1:]) - 1, max_query_len=max(new))


def caches(dtype, cfg=TINY):
    shape = (8 * 8, BLOCK, cfg["num_key_value_heads"], cfg["hidden_size"] // cfg["num_attention_heads"])
    return [(torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype))
            for _ in range(cfg["num_hidden_layers"])]


class Counting:
    """Counts CpuGraph.replay calls while in use."""

    def __init__(self, monkeypatch):
        self.replays, real = 0, cpu_graphs.CpuGraph.replay

        def replay(graph):
            self.replays += 1
            return real(graph)
        monkeypatch.setattr(cpu_graphs.CpuGraph, "replay", replay)


def run(model, dtype, path, eager: bool):
    """Every step of STEPS through the CPU backend bound to `model`, as the runner drives it
    (inputs placed in StepInputs, a decode step padded to a captured size): (each step's rows,
    the KV caches after)."""
    backend = bind(model, Config(cpu_gemm=path, max_num_seqs=8, enforce_eager=eager))
    inputs, kv, outs = StepInputs(64, 8, 8, torch.device("cpu")), caches(dtype), []
    backend.capture(inputs, kv)
    with torch.inference_mode():
        for t, (lengths, new) in enumerate(STEPS):
            host = step(lengths, new)
            ids = torch.randint(0, 128, (sum(new),), generator=torch.Generator().manual_seed(t))
            padded = padded_batch_size(len(new), backend.cudagraph_capture_sizes) if max(new) == 1 else None
            input_ids, positions, md, _ = inputs.place(ids, **host, num_rows=padded)
            hidden = backend.forward(input_ids, positions, kv, backend.build_metadata(md))
            outs.append(hidden[:sum(new)].clone())
    return outs, kv


def assert_same(a, b):
    (outs, kv), (other_outs, other_kv) = a, b
    for t, (ours, theirs) in enumerate(zip(outs, other_outs, strict=True)):
        assert torch.equal(ours, theirs), f"step {t}"
    for (k, v), (k2, v2) in zip(kv, other_kv, strict=True):
        assert torch.equal(k, k2) and torch.equal(v, v2)


@pytest.mark.parametrize("dtype, path", PATHS)
@pytest.mark.parametrize("bias", [False, True])
def test_replay_equals_eager_to_the_bit(dtype, path, bias, monkeypatch):
    if path == "amx" and not cpu_kernels.gemm_amx_ready():
        pytest.skip("no AMX on this CPU")
    counting = Counting(monkeypatch)
    replayed = run(make_model(dtype, bias=bias), dtype, path, eager=False)
    assert counting.replays == 4           # the 4 decode-only steps; the prefill and mixed ones eager
    eager = run(make_model(dtype, bias=bias), dtype, path, eager=True)
    assert counting.replays == 4
    if path in ("torch", "onednn"):        # a library may block 5 rows and 8 differently
        for ours, theirs in zip(replayed[0], eager[0]):
            torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)
        return
    assert_same(replayed, eager)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_qwen3_replay_equals_eager(dtype, monkeypatch):
    """Qwen3's q/k norms between the product and RoPE: still C calls and torch ops, captured."""
    cfg = Qwen3Config(**TINY, head_dim=16, architectures=["Qwen3ForCausalLM"])
    counting = Counting(monkeypatch)
    replayed = run(make_model(dtype, cfg), dtype, "kernel", eager=False)
    assert counting.replays == 4
    assert_same(replayed, run(make_model(dtype, cfg), dtype, "kernel", eager=True))


def captured(dtype=torch.float32, path="kernel", model=None):
    model = model or make_model(dtype)
    backend = bind(model, Config(cpu_gemm=path, max_num_seqs=8))
    inputs, kv = StepInputs(64, 8, 8, torch.device("cpu")), caches(dtype)
    backend.capture(inputs, kv)
    return model, backend, inputs, kv


@pytest.mark.parametrize("dtype, path, gemm", [(torch.float32, "kernel", "gemm"), (torch.bfloat16, "amx", "gemm_amx")])
def test_what_is_recorded_is_the_models_forward(dtype, path, gemm):
    """A forward hook on a layer fires during the capture (once per size: the model ran); the
    record is the layer's ops in the model's order, as the model calls them."""
    if path == "amx" and not cpu_kernels.gemm_amx_ready():
        pytest.skip("no AMX on this CPU")
    model, seen = make_model(dtype), []
    model.model.layers[1].register_forward_hook(lambda module, args, out: seen.append(args[1].shape[0]))
    _, backend, _, _ = captured(dtype, path, model=model)
    assert seen == [8, 4, 2, 1]
    layers = TINY["num_hidden_layers"]
    for size in (8, 1):     # 1 row too: a view may give a size-1 dimension any stride
        graph = backend.forward.graphs[size][0]
        kernels = [call.kernel for call in graph.record if call.kernel]
        assert kernels == ["rms_norm", gemm, "rope_store_kv", "decode_attention", gemm, "rms_norm", gemm,
                           "silu_and_mul", gemm] * layers + ["rms_norm"]
        assert [str(call.fn) for call in graph.record if not call.kernel][-1] == "aten.index.Tensor"


class Allocations(TorchDispatchMode):
    """Every torch op dispatched; a replay may only write into tensors that exist."""

    def __init__(self):
        super().__init__()
        self.functional = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func._schema.is_mutable:
            self.functional.append(func)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("dtype, path", [(torch.bfloat16, "kernel"), (torch.float32, "torch")])
def test_replay_allocates_nothing_and_shares_one_arena(dtype, path):
    model, backend, inputs, kv = captured(dtype, path)
    graphs = backend.forward.graphs
    arena = graphs[8][0].pool.arena
    assert all(graph.pool.arena is arena for graph, _ in graphs.values())
    outputs = {size: graph.output.data_ptr() for size, (graph, _) in graphs.items()}
    host = step([8, 14, 3], [1, 1, 1])
    ids = torch.tensor([5, 6, 7])
    input_ids, positions, md, _ = inputs.place(ids, **host, num_rows=4)
    md = backend.build_metadata(md)    # the runner's, before the forward
    with torch.inference_mode(), Allocations() as seen:
        hidden = backend.forward(input_ids, positions, kv, md)
    assert seen.functional == [] and hidden.data_ptr() == outputs[4]
    assert {size: graph.output.data_ptr() for size, (graph, _) in graphs.items()} == outputs
    # every tensor the 8-row step allocated and used, laid end to end, against the arena they share
    graph = graphs[8][0]
    used = {r.buffer for call in graph.record for r in cpu_graphs.refs(call)}
    assert arena.numel() == graph.size < sum(-(-graph.buffer_sizes[b] // 64) * 64 for b in used) / 4


def test_plan_memory_shares_bytes_between_lifetimes_that_do_not_overlap():
    """plan_memory's docstring example: a (calls 0-1), b (1-2), c (2-3), 64 bytes each."""
    ref = cpu_graphs.Ref
    calls = [cpu_graphs.Call(None, (ref(0, 0),)), cpu_graphs.Call(None, (ref(0, 0), ref(1, 0))),
             cpu_graphs.Call(None, (ref(1, 0), ref(2, 0))), cpu_graphs.Call(None, (ref(2, 0),))]
    where, size = cpu_graphs.plan_memory(calls, [64, 64, 64], output=ref(2, 0))
    assert where == {0: 0, 1: 64, 2: 0} and size == 128
    where, size = cpu_graphs.plan_memory(calls, [64, 100, 64], output=ref(0, 0))   # a lives on
    assert where == {0: 0, 1: 64, 2: 192} and size == 256


def test_a_step_that_reads_values_is_refused():
    graph = cpu_graphs.CpuGraph(cpu_graphs.CpuGraph.new_pool())
    x = torch.ones(4)
    with pytest.raises(RuntimeError, match="cannot be captured"):
        graph.capture(lambda: x * int(x.sum()))
    with pytest.raises(RuntimeError, match="cannot be captured"):
        graph.capture(lambda: x[x > 0])
    with pytest.raises(RuntimeError, match="several new tensors"):
        graph.capture(lambda: x.topk(2).values * 2)


# ------------------------------------------------------------------------ the engine


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_engine_with_capture_gives_the_eager_tokens(checkpoint, dtype, monkeypatch):
    """Greedy, seeded sampling, a preempting pool and chunked prefills: the same tokens with
    capture on and with --enforce-eager; decode steps replayed, the others eager."""
    path, _ = checkpoint
    rng = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, 300, (n,), generator=rng).tolist() for n in (3, 40, 17, 60, 9, 33)]
    params = [SamplingParams(max_tokens=20, temperature=0.0),
              SamplingParams(max_tokens=20, temperature=0.8, top_p=0.9, seed=7)] * 3
    results = {}
    for eager in (False, True):
        counting = Counting(monkeypatch)
        llm = LLM(path, block_size=16, max_model_len=128, num_kv_blocks=10, max_num_seqs=8,
                  max_num_batched_tokens=32, dtype=dtype, enforce_eager=eager)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, progress=False)
        results[eager] = [o.outputs[0].token_ids for o in outs]
        assert (counting.replays == 0) == eager
        assert llm.engine.scheduler.num_preemptions_total > 0 or eager
    assert results[False] == results[True]
