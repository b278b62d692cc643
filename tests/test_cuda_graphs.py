"""CUDA graphs' bookkeeping, on CPU (no GPU, nothing timed): the capture sizes and the padding of
a decode step up to one (step_inputs.py), the persistent inputs that keep their addresses, a
padded step == the unpadded one on the torch reference, the CPU backend and the Triton kernels
(interpreted), and cuda/graphs.py's capture and replay with a stand-in for torch.cuda.CUDAGraph
that runs the forward: the model's own forward is what is captured (its hooks fire), and greedy
through padded, replayed decode steps == HF generate.

    pytest -q tests/test_cuda_graphs.py

scripts/gpu_smoke.py's `graphs` section checks the real capture on a GPU.
"""

import argparse
import functools
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: the kernels on CPU

import pytest  # noqa: E402
import torch  # noqa: E402
from transformers import LlamaConfig  # noqa: E402

from nanoserve import LLM  # noqa: E402
from nanoserve.config import Config  # noqa: E402
from nanoserve.cpu import kernels as cpu_kernels  # noqa: E402
from nanoserve.graph_capture import GraphWrapper  # noqa: E402
from nanoserve.layers import Attention, RMSNorm, RopeStoreKV, SiluAndMul  # noqa: E402
from nanoserve.models import get_model_class  # noqa: E402
from nanoserve.step_inputs import PAD_SLOT_ID, StepInputs, padded_batch_size  # noqa: E402

CPU = torch.device("cpu")
BLOCK = 4


# ------------------------------------------------------------------------ sizes and padding


def test_padded_size_is_the_smallest_captured_size_at_least_n():
    sizes = Config(max_num_seqs=512, max_num_batched_tokens=4096).cudagraph_capture_sizes
    assert sizes[:5] == [1, 2, 4, 8, 16] and sizes[-3:] == [480, 496, 512]
    for n in range(1, 513):
        padded = padded_batch_size(n, sizes)
        assert padded in sizes and padded >= n and not any(n <= s < padded for s in sizes)
    assert padded_batch_size(513, sizes) is None and padded_batch_size(3, []) is None


def test_capture_sizes_are_capped_deduplicated_and_off_when_eager():
    assert Config(max_num_seqs=20).cudagraph_capture_sizes == [1, 2, 4, 8, 16]
    assert Config(max_num_batched_tokens=6).cudagraph_capture_sizes == [1, 2, 4]
    assert Config(cudagraph_capture_sizes=[8, 2, 2, 100], max_num_seqs=64).cudagraph_capture_sizes == [2, 8]
    assert Config(enforce_eager=True).cudagraph_capture_sizes == []
    resolved = Config(max_num_seqs=8).resolve(max_position_embeddings=64, num_kv_blocks=4)
    assert resolved.cudagraph_capture_sizes == [1, 2, 4, 8]
    with pytest.raises(ValueError, match="cudagraph_capture_sizes"):
        Config(cudagraph_capture_sizes=[0, 4])


def test_graph_flags_round_trip_through_the_cli():
    parser = argparse.ArgumentParser()
    Config.add_cli_args(parser)
    args = parser.parse_args(["--enforce-eager", "--cudagraph-capture-sizes", "1", "2", "4"])
    assert Config.from_cli_args(args).enforce_eager and args.cudagraph_capture_sizes == [1, 2, 4]
    config = Config.from_cli_args(parser.parse_args(["--cudagraph-capture-sizes", "4", "1"]))
    assert config.cudagraph_capture_sizes == [1, 4] and not config.enforce_eager
    assert Config.from_cli_args(parser.parse_args([])) == Config()


# ------------------------------------------------------------------------ a tiny model's steps


def make_model():
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      architectures=["LlamaForCausalLM"])
    torch.manual_seed(0)
    model = get_model_class(cfg)(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn_like(p) * 0.2 + (1.0 if "norm" in name else 0.0))
    return model


def new_kv_caches(num_blocks=16):
    g = torch.Generator().manual_seed(1)   # random contents: a wrong read shows
    return [tuple(torch.randn(num_blocks, BLOCK, 2, 16, generator=g) for _ in range(2))
            for _ in range(2)]


def decode_step(seq_lens: list[int], tables: list[list[int]]):
    """The host tensors of a decode step (one new token each) at the end of each sequence."""
    pos = torch.tensor(seq_lens) - 1
    slots = torch.tensor([t[p // BLOCK] * BLOCK + p % BLOCK for t, p in zip(tables, pos.tolist())])
    width = max(map(len, tables))
    return dict(input_ids=torch.arange(3, 3 + len(seq_lens)), positions=pos, slot_mapping=slots,
                seq_lens=torch.tensor(seq_lens), query_start_loc=torch.arange(len(seq_lens) + 1),
                block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
                logits_indices=torch.arange(len(seq_lens)), max_query_len=1)


STEP = dict(seq_lens=[5, 12, 9], tables=[[3, 11], [7, 1, 10], [2, 14, 6]])


def test_inputs_keep_their_addresses_and_pad_inert():
    inputs = StepInputs(64, 8, 8, CPU)
    ptrs = {name: view.data_ptr() for name, view in inputs.views.items()}
    storage = inputs.buffer.untyped_storage().data_ptr()
    for num_rows in (None, 4, 8, None):
        input_ids, positions, meta, logits_indices = inputs.place(**decode_step(**STEP), num_rows=num_rows)
        fields = ("slot_mapping", "seq_lens", "query_start_loc", "block_tables")
        for name, t in (("input_ids", input_ids), ("positions", positions),
                        ("logits_indices", logits_indices), *((n, getattr(meta, n)) for n in fields)):
            assert t.data_ptr() == ptrs[name] and t.untyped_storage().data_ptr() == storage, name
    assert {name: view.data_ptr() for name, view in inputs.views.items()} == ptrs
    _, _, meta, _ = inputs.place(**decode_step(**STEP), num_rows=8)
    assert meta.slot_mapping[3:].tolist() == [PAD_SLOT_ID] * 5 and meta.seq_lens[3:].tolist() == [0] * 5
    assert meta.query_start_loc.tolist() == [0, 1, 2, 3, 3, 3, 3, 3, 3]
    with pytest.raises(ValueError, match="past the step buffers"):
        inputs.place(**decode_step(**STEP), num_rows=16)


def triton_forms(model):
    """The CUDA backend's Triton forms (cuda/backend.py: norms, RoPE + store, silu·mul, attention,
    split-K at these batch sizes) on `model`, interpreted on CPU."""
    from triton_kit import triton_modules
    cuda_backend = triton_modules()[-1]
    for module in model.modules():
        if isinstance(module, RMSNorm):
            module.impl = functools.partial(cuda_backend.rms_norm, module)
        elif isinstance(module, SiluAndMul):
            module.impl = cuda_backend.silu_and_mul_triton
        elif isinstance(module, RopeStoreKV):
            module.impl = cuda_backend.rope_store_kv
        elif isinstance(module, Attention):
            module.impl = functools.partial(cuda_backend.attention, module)
    return model, lambda md: md


def bound(backend: str):
    """(forward, build_metadata) of the tiny model on `backend`."""
    model = make_model()
    if backend == "torch":
        return model, lambda md: md
    if backend == "triton":
        return triton_forms(model)
    from nanoserve.cpu.backend import bind
    cpu = bind(model, Config(cpu_gemm="kernel"))
    return cpu.forward, cpu.build_metadata


BACKENDS = ["torch",
            pytest.param("cpu", marks=pytest.mark.skipif(cpu_kernels.load() is None, reason="no C")),
            pytest.param("triton", marks=pytest.mark.skipif(os.environ["TRITON_INTERPRET"] != "1",
                                                            reason="interpreted: a CPU test"))]


@pytest.mark.parametrize("backend", BACKENDS)
@torch.inference_mode()
def test_padded_step_equals_unpadded(backend):
    """3 decodes run as they are, then padded to 8 on the same cache: the real rows' results are
    the same, and the padding stores nothing (the cache differs nowhere outside the 3 slots)."""
    forward, build_metadata = bound(backend)
    inputs, before, results = StepInputs(64, 8, 8, CPU), new_kv_caches(), []
    step = decode_step(**STEP)
    for num_rows in (None, 8):
        caches = [(k.clone(), v.clone()) for k, v in before]
        input_ids, positions, meta, _ = inputs.place(**step, num_rows=num_rows)
        hidden = forward(input_ids, positions, caches, build_metadata(meta))
        results.append((hidden[:3].clone(), caches))
    (eager, eager_caches), (padded, padded_caches) = results
    # gemm.c's rows do not depend on how many there are; F.linear (MKL) may block 3 rows and 8
    # differently, so the torch products agree to float32 rounding.
    same = torch.equal if backend == "cpu" else functools.partial(torch.allclose, rtol=1e-5, atol=1e-6)
    assert padded.shape == eager.shape and same(padded, eager)
    real = torch.zeros(16 * BLOCK, dtype=torch.bool)
    real[step["slot_mapping"]] = True
    for (k0, v0), (k1, v1), (k2, v2) in zip(before, eager_caches, padded_caches):
        for old, unpadded, new in ((k0, k1, k2), (v0, v1, v2)):
            rows = lambda t: t.view(16 * BLOCK, -1)
            assert torch.equal(rows(new)[~real], rows(old)[~real])
            assert same(rows(new)[real], rows(unpadded)[real])


# ------------------------------------------------------------------------ capture and replay


class StandInGraph:
    """torch.cuda.CUDAGraph's part in graphs.py, on CPU: capture runs the forward and keeps it;
    replay runs it again into the same output tensor (a graph rewrites its output in place)."""
    captured: list[int] = []   # the sizes, in capture order
    replays = 0

    def __init__(self, pool):
        self.forward = self.output = None

    @staticmethod
    def new_pool():
        return None

    def capture(self, forward):
        self.forward, self.output = forward, forward()
        StandInGraph.captured.append(self.output.shape[0])
        return self.output

    def replay(self):
        StandInGraph.replays += 1
        return self.output.copy_(self.forward())


@torch.inference_mode()
def test_capture_records_the_models_forward_largest_first():
    model, calls = make_model(), []
    model.model.layers[0].register_forward_hook(lambda module, args, out: calls.append(args[1].shape[0]))
    inputs, caches = StepInputs(64, 8, 8, CPU), new_kv_caches()
    StandInGraph.captured, StandInGraph.replays = [], 0
    graphs = GraphWrapper(model, [1, 2, 4, 8], StandInGraph)
    graphs.capture(inputs, caches)
    assert StandInGraph.captured == [8, 4, 2, 1]
    assert calls == [8, 4, 2, 1]   # the capture per size: the model ran
    input_ids, positions, meta, _ = inputs.place(**decode_step(**STEP), num_rows=4)
    replayed = graphs(input_ids, positions, caches, meta).clone()
    assert StandInGraph.replays == 1
    # Eager at the same size, in the real rows (a padded row's attention output is never written).
    assert torch.equal(replayed[:3], model(input_ids, positions, caches, meta)[:3])
    for num_rows, kv in ((None, caches), (4, new_kv_caches())):   # unpadded; another KV cache
        input_ids, positions, meta, _ = inputs.place(**decode_step(**STEP), num_rows=num_rows)
        graphs(input_ids, positions, kv, meta)
    assert StandInGraph.replays == 1


def test_bind_captures_at_one_rank_unless_eager(monkeypatch):
    """cuda/backend.py's bind, on CPU (its compile and the device query stubbed): the forward is
    wrapped for graphs at one rank; under enforce_eager or tensor parallel it is the model."""
    import nanoserve.cuda.backend as cuda_backend
    monkeypatch.setattr(cuda_backend, "compile_kernels", lambda *args: None)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    for config, sizes in ((Config(max_num_seqs=8), [1, 2, 4, 8]), (Config(enforce_eager=True), []),
                          (Config(tensor_parallel_size=2), [])):
        model = make_model()
        backend = cuda_backend.bind(model, config, {})
        assert backend.cudagraph_capture_sizes == sizes
        assert isinstance(backend.forward, GraphWrapper) if sizes else backend.forward is model


@pytest.mark.parametrize("kernels", ["0", "1"])
def test_greedy_through_replayed_decode_steps_equals_hf(checkpoint, kernels, monkeypatch):
    """The engine with its decode steps padded and replayed (the stand-in) == HF, token for token,
    on Llama, Qwen2 and Qwen3, on the torch reference and the CPU backend; prefills run eagerly."""
    from test_llm import check_against_hf, workload
    monkeypatch.setenv("NANOSERVE_CPU_KERNEL", kernels)
    path, hf_model = checkpoint
    llm = LLM(path, block_size=16, max_model_len=256, num_kv_blocks=256, max_num_seqs=8)
    runner, sizes = llm.engine.executor.model_runner, [1, 2, 4, 8]
    graphs = GraphWrapper(runner.backend.forward, sizes, StandInGraph)
    StandInGraph.replays = 0
    graphs.capture(runner.inputs, runner.kv_caches)
    runner.backend.forward, runner.backend.cudagraph_capture_sizes = graphs, sizes
    prompts, max_tokens = workload(n=6)
    check_against_hf(llm, hf_model, prompts, max_tokens)
    assert StandInGraph.replays > 10
