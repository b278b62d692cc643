"""Tensor parallel (executor.py, distributed.py, models/llama.py sharding): with
tensor_parallel_size=2 over gloo on CPU, greedy output equals TP=1 and HF `generate` token for
token; a rank loads only its slice of each tensor; a dead worker is an error, not a hang; no
worker process outlives its LLM."""

import gc
import os
import signal
import time

import pytest
import torch

from conftest import build_checkpoint
from nanoserve import LLM, SamplingParams
from nanoserve.distributed import TensorParallel
from nanoserve.models import LlamaForCausalLM
from nanoserve.model_loader import iterate_weights
from test_llm import GREEDY, hf_greedy, workload

CHECKPOINTS = {   # name -> (arch, tied, overrides)
    "llama-2kv": ("llama", False, {}),
    # One KV head for two ranks: both keep a replica. Biases everywhere: the row-parallel ones
    # (o_proj, down_proj) must be added once, not once per rank.
    "llama-1kv-bias": ("llama", False, dict(num_key_value_heads=1, attention_bias=True,
                                            mlp_bias=True)),
    # q/k norms, a tied embedding, and a vocabulary 2 does not divide (rank 1's slice padded).
    "qwen3-tied-odd-vocab": ("qwen3", True, dict(vocab_size=383)),
}   # three checkpoints, not more: starting two worker processes takes seconds (imports)


@pytest.fixture(scope="module", params=list(CHECKPOINTS))
def tp_checkpoint(request, tmp_path_factory):
    arch, tie, overrides = CHECKPOINTS[request.param]
    path = tmp_path_factory.mktemp(request.param)
    return str(path), build_checkpoint(path, arch, tie=tie, **overrides)


def run(path, prompts, max_tokens, **kwargs):
    llm = LLM(path, block_size=16, num_kv_blocks=64, max_model_len=256, **kwargs)
    params = [SamplingParams(max_tokens=m, **GREEDY) for m in max_tokens]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, progress=False)
    return llm, [o.outputs[0].token_ids for o in outs]


def test_tp2_greedy_equals_tp1_and_hf_and_leaves_no_worker(tp_checkpoint):
    path, model = tp_checkpoint
    prompts, max_tokens = workload(n=4, vocab=model.config.vocab_size)
    prompts, max_tokens = [p[:60] for p in prompts], [min(m, 10) for m in max_tokens]
    _, tp1 = run(path, prompts, max_tokens)
    llm, tp2 = run(path, prompts, max_tokens, tensor_parallel_size=2)
    assert tp2 == tp1 == [hf_greedy(model, p, m) for p, m in zip(prompts, max_tokens)]
    procs = llm.engine.executor.procs
    assert len(procs) == 2 and all(p.is_alive() for p in procs)
    del llm
    gc.collect()
    assert not any(p.is_alive() for p in procs)


def test_a_rank_reads_only_its_slice(tmp_path):
    hf = build_checkpoint(tmp_path, "llama", num_key_value_heads=2)
    full = hf.state_dict()
    reads = {}

    class Recorded:   # a safetensors slice that notes what part of it is read
        def __init__(self, name, part):
            self.name, self.part = name, part

        def get_shape(self):
            return self.part.get_shape()

        def __getitem__(self, index):
            reads[self.name] = tensor = self.part[index]
            return tensor

    model = LlamaForCausalLM(hf.config, TensorParallel(rank=1, size=2))
    model.load_weights((name, Recorded(name, part)) for name, part in iterate_weights(tmp_path))
    layer, q, kv, mlp = "model.layers.0.", 2 * 16, 16, 64    # rank 1 of 2: 2 of 4 heads, ...
    assert reads[layer + "self_attn.q_proj.weight"].shape == (q, 64)
    assert reads[layer + "self_attn.k_proj.weight"].shape == (kv, 64)
    assert reads[layer + "mlp.up_proj.weight"].shape == (mlp, 64)
    assert reads[layer + "self_attn.o_proj.weight"].shape == (64, q)
    assert reads["model.embed_tokens.weight"].shape == (192, 64)
    attn, ours = model.model.layers[0].self_attn, model.model.layers[0]
    assert attn.qkv_proj.weight.shape == (q + 2 * kv, 64) and attn.o_proj.weight.shape == (64, q)
    torch.testing.assert_close(attn.qkv_proj.weight[:q], full[layer + "self_attn.q_proj.weight"][q:])
    torch.testing.assert_close(attn.qkv_proj.weight[q + kv:],
                               full[layer + "self_attn.v_proj.weight"][kv:])
    torch.testing.assert_close(ours.mlp.gate_up_proj.weight[mlp:], full[layer + "mlp.up_proj.weight"][mlp:])
    torch.testing.assert_close(ours.mlp.down_proj.weight, full[layer + "mlp.down_proj.weight"][:, mlp:])
    torch.testing.assert_close(model.lm_head.weight, full["lm_head.weight"][192:])


def test_one_kv_head_is_replicated_on_both_ranks(tmp_path):
    hf = build_checkpoint(tmp_path, "llama", num_key_value_heads=1)
    k = hf.state_dict()["model.layers.1.self_attn.k_proj.weight"]
    for rank in (0, 1):
        model = LlamaForCausalLM(hf.config, TensorParallel(rank=rank, size=2))
        model.load_weights(iterate_weights(tmp_path))
        torch.testing.assert_close(model.model.layers[1].self_attn.qkv_proj.weight[32:48], k)


def test_tp_size_the_heads_cannot_split_is_a_clear_error(tmp_path):
    build_checkpoint(tmp_path, "llama")
    with pytest.raises(ValueError, match="tensor_parallel_size 3 must divide num_attention_heads"):
        LLM(str(tmp_path), tensor_parallel_size=3)


def test_an_mlp_the_ranks_cannot_split_is_a_clear_error_and_experts_whole_need_not_split():
    """The dense MLP's intermediate size must split tp ways; Mixtral has no dense MLP, so under
    expert parallel (whole experts) an intermediate size that tp does not divide is no obstacle."""
    from transformers import LlamaConfig, MixtralConfig
    from nanoserve.models import verify_with_parallel_config
    shape = dict(hidden_size=64, intermediate_size=99, num_attention_heads=4, num_key_value_heads=2,
                 num_hidden_layers=2, vocab_size=128)
    llama = LlamaConfig(**shape, architectures=["LlamaForCausalLM"])
    with pytest.raises(ValueError, match=r"tensor_parallel_size 2 must divide intermediate_size \(99\)"):
        verify_with_parallel_config(llama, 2, False)
    mixtral = MixtralConfig(**shape, num_local_experts=4, num_experts_per_tok=2,
                             architectures=["MixtralForCausalLM"])
    with pytest.raises(ValueError, match="must divide the experts' intermediate size"):
        verify_with_parallel_config(mixtral, 2, False)
    verify_with_parallel_config(mixtral, 2, True)      # 2 whole experts a rank


def test_killed_worker_is_an_error_not_a_hang(tmp_path):
    build_checkpoint(tmp_path, "llama")
    llm = LLM(str(tmp_path), block_size=16, num_kv_blocks=64, tensor_parallel_size=2)
    procs = llm.engine.executor.procs
    os.kill(procs[1].pid, signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(Exception, match="worker rank 1 .*died"):
        llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=4), progress=False)
    assert not any(p.is_alive() for p in procs)      # rank 0 was stopped too: no orphan
    assert time.monotonic() - start < 30
    with pytest.raises(Exception, match="workers are down"):   # and stays an error
        llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=4), progress=False)
