"""Mixture of experts (models/mixture_of_experts.py, layers.FusedMoE): Qwen3-MoE and Mixtral.

  - greedy == HF `generate`, token for token, on tiny random checkpoints in float32 (Qwen3-MoE with
    norm_topk_prob on and off and a dense mlp_only layer; Mixtral): roomy, preempting, chunked
    prefill; on the CPU backend (decode steps captured and replayed, FusedMoE one opaque call in
    the record) and on the torch reference;
  - TP=2 over gloo, each rank a slice of every expert, and with enable_expert_parallel, each rank
    half the experts whole: == HF; under expert parallel a rank reads only its experts' tensors;
  - --quantization int8 quantizes each expert per output channel, the router not: the logits are
    those of the model with those weights dequantized;
  - the error of experts that do not split over the ranks (with data parallel:
    test_expert_parallel.py).

    pytest -q tests/test_moe.py
"""

import copy

import pytest
import torch
import transformers as tf

from conftest import build_checkpoint
from nanoserve import LLM, Config, SamplingParams
from nanoserve.cpu import kernels as cpu_kernels
from nanoserve.distributed import TensorParallel
from nanoserve.layers import FusedMoE, select_experts
from nanoserve.model_loader import iterate_weights
from nanoserve.model_runner import ModelRunner
from nanoserve.models import MixtralForCausalLM, verify_with_parallel_config
from nanoserve.quantization import dequantize, quantize
from test_llm import GREEDY, hf_greedy, workload
from test_quantization import logits_of
from test_cpu_graphs import Counting

CHECKPOINTS = {   # name -> (arch, overrides of conftest's TINY)
    "qwen3moe-renormalized": ("qwen3_moe", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                                norm_topk_prob=True, mlp_only_layers=[1])),
    "qwen3moe": ("qwen3_moe", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                   norm_topk_prob=False)),
    "mixtral": ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=48)),
}
SETUPS = {"roomy": dict(num_kv_blocks=256),
          "preempt": dict(num_kv_blocks=16, max_num_seqs=8),
          "chunked": dict(num_kv_blocks=256, max_num_batched_tokens=48)}
needs_kernels = pytest.mark.skipif(cpu_kernels.load() is None, reason="no C compiler here")
EXPECTED = {}    # (checkpoint, prompt, max_tokens) -> HF's greedy tokens: each computed once


@pytest.fixture(scope="module", params=list(CHECKPOINTS))
def moe_checkpoint(request, tmp_path_factory):
    arch, overrides = CHECKPOINTS[request.param]
    path = tmp_path_factory.mktemp(request.param)
    return str(path), build_checkpoint(path, arch, **overrides)


def check_greedy(llm, path, hf, prompts, max_tokens):
    params = [SamplingParams(max_tokens=m, **GREEDY) for m in max_tokens]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, progress=False)
    for prompt, m, out in zip(prompts, max_tokens, outs):
        key = (path, tuple(prompt), m)
        if key not in EXPECTED:
            EXPECTED[key] = hf_greedy(hf, prompt, m)
        assert out.outputs[0].token_ids == EXPECTED[key], f"prompt of {len(prompt)} tokens"
    pool = llm.engine.kv_cache_manager.pool
    assert pool.num_free_blocks == pool.num_blocks


def moe_workload(setup):
    prompts, max_tokens = workload(n=8)
    if setup == "preempt":   # 8 prompts of 3 blocks that grow to 4: 16 blocks cannot hold them
        return [p[:40] + [7] * (40 - len(p)) for p in prompts], [24] * 8
    return prompts, max_tokens


@pytest.mark.parametrize("backend", [pytest.param("cpu", marks=needs_kernels), "torch"])
@pytest.mark.parametrize("setup", list(SETUPS))
def test_greedy_equals_hf(moe_checkpoint, setup, backend, monkeypatch):
    path, hf = moe_checkpoint
    if backend == "torch":
        monkeypatch.setenv("NANOSERVE_CPU_KERNEL", "0")
    counting = Counting(monkeypatch)
    llm = LLM(path, block_size=16, max_model_len=256, cpu_gemm="kernel", **SETUPS[setup])
    assert llm.engine.executor.model_runner.backend.name == backend
    check_greedy(llm, path, hf, *moe_workload(setup))
    # The CPU backend captures MoE decode steps too (FusedMoE one opaque call in the record); the
    # torch reference captures nothing.
    assert (counting.replays > 0) == (backend == "cpu")
    if setup == "preempt":
        assert llm.engine.scheduler.num_preemptions_total > 0


def test_tiny_routers_spread_tokens_over_every_expert(moe_checkpoint):
    """The oracle means something: every expert of every sparse layer gets tokens of a prompt."""
    path, _ = moe_checkpoint
    runner = ModelRunner(Config(model=path, num_kv_blocks=8, max_model_len=128, enforce_eager=True))
    used = {}
    for name, module in runner.model.named_modules():
        if isinstance(module, FusedMoE):
            module.register_forward_hook(lambda m, args, out, name=name: used.setdefault(name, set()).update(
                select_experts(args[1], m.top_k, m.renormalize)[1].flatten().tolist()))
    logits_of(runner, list(range(1, 60)))
    assert used and all(experts == set(range(4)) for experts in used.values()), used


@pytest.fixture(scope="module")
def qwen3moe(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3moe-tp")
    arch, overrides = CHECKPOINTS["qwen3moe-renormalized"]
    return str(path), build_checkpoint(path, arch, **overrides)


@pytest.mark.parametrize("expert_parallel", [False, True])
def test_tp2_with_and_without_expert_parallel_equals_hf(qwen3moe, expert_parallel):
    path, hf = qwen3moe
    prompts, max_tokens = workload(n=4)
    prompts, max_tokens = [p[:60] for p in prompts], [min(m, 10) for m in max_tokens]
    llm = LLM(path, block_size=16, num_kv_blocks=64, max_model_len=256, tensor_parallel_size=2,
              enable_expert_parallel=expert_parallel)
    check_greedy(llm, path, hf, prompts, max_tokens)


class Recorded:
    """A safetensors slice that notes the part of it that is read."""

    def __init__(self, reads, name, part):
        self.reads, self.name, self.part = reads, name, part

    def get_shape(self):
        return self.part.get_shape()

    def __getitem__(self, index):
        self.reads[self.name] = tensor = self.part[index]
        return tensor


@pytest.mark.parametrize("expert_parallel", [False, True])
def test_a_rank_reads_only_its_experts_or_its_slice_of_each(tmp_path, expert_parallel):
    """Rank 1 of 2 (4 experts, intermediate 48): under expert parallel it reads experts 2 and 3
    whole and never touches 0 and 1; without, the rows 24..48 of every expert's gate and up and
    those columns of its down. The router is read whole either way."""
    hf = build_checkpoint(tmp_path, "mixtral", num_local_experts=4, num_experts_per_tok=2, intermediate_size=48)
    full, reads = hf.state_dict(), {}
    model = MixtralForCausalLM(hf.config, TensorParallel(1, 2, expert_parallel))
    model.load_weights((name, Recorded(reads, name, part)) for name, part in iterate_weights(tmp_path))
    moe, prefix = model.model.layers[0].mlp, "model.layers.0.block_sparse_moe"
    read = {int(n.split(".")[5]) for n in reads if n.startswith(f"{prefix}.experts.")}
    assert read == ({2, 3} if expert_parallel else {0, 1, 2, 3})
    assert reads[f"{prefix}.gate.weight"].shape == (4, 64)
    w13, w2 = full["model.layers.0.mlp.experts.gate_up_proj"], full["model.layers.0.mlp.experts.down_proj"]
    if expert_parallel:          # HF's fused [E, 2I, H] and [E, H, I]: ours are its experts 2, 3
        assert moe.experts.expert_ids == [2, 3] and reads[f"{prefix}.experts.3.w1.weight"].shape == (48, 64)
        torch.testing.assert_close(moe.experts.w13_weight, w13[2:])
        torch.testing.assert_close(moe.experts.w2_weight, w2[2:])
    else:
        assert moe.experts.expert_ids == [0, 1, 2, 3] and reads[f"{prefix}.experts.3.w2.weight"].shape == (64, 24)
        torch.testing.assert_close(moe.experts.w13_weight, torch.cat([w13[:, 24:48], w13[:, 72:]], dim=1))
        torch.testing.assert_close(moe.experts.w2_weight, w2[:, :, 24:])


def test_int8_quantizes_each_expert_and_not_the_router(tmp_path):
    """The experts (and attention) in int8 with one scale per expert per output row, the router
    in float32; the logits equal HF's on the same weights quantized and dequantized."""
    hf = build_checkpoint(tmp_path, "qwen3_moe", **CHECKPOINTS["qwen3moe-renormalized"][1])
    runner = ModelRunner(Config(model=str(tmp_path), quantization="int8", cpu_gemm="kernel",
                                num_kv_blocks=8, max_model_len=128, enforce_eager=True))
    block = runner.model.model.layers[0].mlp
    assert block.experts.w13_weight_scale.shape == (4, 64) and block.experts.w2_weight_scale.shape == (4, 64)
    assert block.gate.quantization is None
    # The CPU form holds the int8 experts now (gemm.py's labels): w13 64 -> 64, w2 32 -> 64.
    assert {"64x64 int8 experts", "32x64 int8 experts", "64x4 float32"} <= set(runner.backend.gemm_paths)
    reference = copy.deepcopy(hf)
    with torch.no_grad():
        for name, p in reference.named_parameters():
            if p.dim() >= 2 and "embed" not in name and "lm_head" not in name and not name.endswith("mlp.gate.weight"):
                rows = p.reshape(-1, p.shape[-1])      # an expert's rows, or a Linear's
                p.copy_(dequantize(*quantize(rows, "int8"), torch.float32).view_as(p))
    ids = list(range(3, 50))
    expected = reference(input_ids=torch.tensor([ids])).logits[0]
    torch.testing.assert_close(logits_of(runner, ids), expected, atol=1e-4 * expected.abs().max().item(), rtol=1e-4)


def test_experts_that_do_not_split_are_errors():
    cfg = tf.Qwen3MoeConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                            num_key_value_heads=2, vocab_size=64, num_experts=3, moe_intermediate_size=32,
                            architectures=["Qwen3MoeForCausalLM"])
    verify_with_parallel_config(cfg, 2)          # a slice of each expert: 32 rows split
    with pytest.raises(ValueError, match=r"enable_expert_parallel: tensor_parallel_size 2 must divide "
                                         r"num_experts \(3\)"):
        verify_with_parallel_config(cfg, 2, enable_expert_parallel=True)


def test_trace_records_each_steps_expert_load(tmp_path, monkeypatch):
    """--trace: an expert_load event for every step that ran the model, decode steps replayed from
    a capture included; each layer's counts sum to the step's tokens x top_k (padding rows not
    counted), and equal what a hook on FusedMoE counts in the same run with --enforce-eager."""
    from nanoserve.trace import Trace
    from nanoserve.tools.replay_plots import summary
    build_checkpoint(tmp_path / "ckpt", "mixtral", num_local_experts=4, num_experts_per_tok=2,
                     intermediate_size=48)
    prompts, max_tokens = workload(n=5)
    params = [SamplingParams(max_tokens=m, **GREEDY) for m in max_tokens]
    traces = {}
    for eager in (False, True):
        counting, hooked = Counting(monkeypatch), []
        path = str(tmp_path / f"{eager}.jsonl")
        llm = LLM(str(tmp_path / "ckpt"), max_model_len=256, num_kv_blocks=64, max_num_seqs=8,
                  trace=path, enforce_eager=eager)
        if eager:
            for m in llm.engine.executor.model_runner.model.modules():
                if isinstance(m, FusedMoE):
                    m.register_forward_hook(lambda m, args, out: hooked.append(torch.bincount(
                        select_experts(args[1], m.top_k, m.renormalize)[1].flatten(), minlength=4).tolist()))
        llm.generate([{"prompt_token_ids": p} for p in prompts], params, progress=False)
        llm.engine.tracer.close()
        assert (counting.replays > 0) != eager
        traces[eager] = Trace.load(path)
    captured, eager = traces[False], traces[True]
    for step, counts in captured.expert_load.items():
        tokens = sum(captured.frames[step].schedule["scheduled"].values())
        assert len(counts) == 2 and all(sum(layer) == 2 * tokens for layer in counts), step
    assert captured.expert_load == eager.expert_load       # the same schedule, the same routing
    assert [layer for step in sorted(eager.expert_load) for layer in eager.expert_load[step]] == hooked
    assert len(captured.expert_load) == len([f for f in captured.frames.values() if f.schedule])
    assert summary(captured)["expert_load"]["experts"] == 4
