"""Data parallel + expert parallel (`--data-parallel-size 2 --enable-expert-parallel`): the N engine
cores share a mixture of experts' experts out whole and exchange tokens in every MoE layer
(distributed.py's dispatch / combine), stepping in lockstep (engine_core.py's must_step, dummy
steps on a rank with no work). The oracles:

  - the exchange over 2 gloo processes == one process's FusedMoE on every rank's tokens at once,
    with unequal token counts, one rank with none;
  - served (HTTP, 16 concurrent greedy requests, and one alone while the other rank idles) == the
    offline single engine, token for token;
  - a dummy step (a core with no work) writes no KV and samples nothing;
  - a rank killed mid-stream: every open stream ends with an error, /health 503, SIGTERM of the
    server leaves no process;
  - what is not built is a ValueError naming its field (TP > 1, ranks on other hosts, experts
    that do not split over the ranks); a dense model under the flag is plain data parallel.

    python -m pytest -q tests/test_expert_parallel.py
"""

import asyncio
import json
import os
import re
import signal
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
import torch
import torch.multiprocessing as mp
import transformers as tf

from conftest import build_checkpoint
from nanoserve import LLM, AsyncLLM, SamplingParams
from nanoserve.config import Config
from nanoserve.distributed import SINGLE, init_data_parallel_experts
from nanoserve.executor import join_data_parallel_experts
from nanoserve.layers import FusedMoE
from nanoserve.model_runner import ModelRunner
from nanoserve.models import verify_with_parallel_config
from test_api import CONFIG, _descendants, serve
from test_data_parallel import concurrent_greedy, serve_process, wait_all_gone

MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
           mlp_only_layers=[1])     # layer 0 sparse (the exchange), layer 1 dense
MAX_TOKENS = 8
EP = ["--data-parallel-size", "2", "--enable-expert-parallel"]
# (tokens on rank 0, tokens on rank 1) per case: unequal, and a rank with none
CASES = [(5, 2), (0, 3), (1, 1)]
E, TOP_K, HIDDEN, INTERMEDIATE = 4, 2, 16, 8


def _experts(expert_ids=None) -> FusedMoE:
    torch.manual_seed(0)
    full = FusedMoE(E, TOP_K, HIDDEN, INTERMEDIATE, renormalize=True)
    for p in full.parameters():
        p.data.normal_()
    if expert_ids is None:
        return full
    part = FusedMoE(E, TOP_K, HIDDEN, INTERMEDIATE, renormalize=True, expert_ids=expert_ids)
    part.w13_weight.data, part.w2_weight.data = (full.w13_weight.data[list(expert_ids)],
                                                 full.w2_weight.data[list(expert_ids)])
    return part


def _tokens(case: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 * case + rank)
    n = CASES[case][rank]
    return torch.randn(n, HIDDEN, generator=generator), torch.randn(n, E, generator=generator)


@torch.inference_mode()
def _exchange_rank(rank: int, store: str, out_dir: str) -> None:
    """One DP rank: its half of the experts, each case's tokens through dispatch -> experts -> combine."""
    tp = init_data_parallel_experts(rank, 2, store, timeout_s=60)
    experts = _experts(range(rank * E // 2, (rank + 1) * E // 2))
    outs = []
    for case in range(len(CASES)):
        hidden, logits = _tokens(case, rank)
        exchange = tp.expert_exchange
        exchange.begin(len(hidden))                  # once a forward: every rank's rows
        outs.append(exchange.combine(experts(*exchange.dispatch(hidden, logits))))
    torch.save(outs, f"{out_dir}/rank{rank}.pt")


def test_dispatch_combine_over_two_processes_equals_one_process(tmp_path):
    mp.spawn(_exchange_rank, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=2)
    full = _experts().requires_grad_(False)
    for case, counts in enumerate(CASES):
        hidden, logits = (torch.cat(parts) for parts in zip(*(_tokens(case, r) for r in (0, 1))))
        expected = full.forward_native(hidden, logits).split(counts)
        for rank in (0, 1):
            got = torch.load(tmp_path / f"rank{rank}.pt")[case]
            assert got.shape == (counts[rank], HIDDEN)
            torch.testing.assert_close(got, expected[rank], rtol=1e-5, atol=1e-5)


def test_what_is_not_built_is_an_error_naming_its_field(tmp_path):
    for bad, field in [(dict(tensor_parallel_size=2), "tensor_parallel_size 1"),
                       (dict(data_parallel_size_local=1), "data_parallel_size_local"),
                       (dict(headless=True, data_parallel_rank=1), "--headless")]:
        with pytest.raises(ValueError, match=field):
            Config(data_parallel_size=2, enable_expert_parallel=True, **bad)
    cfg = tf.Qwen3MoeConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                            num_attention_heads=4, num_key_value_heads=2, vocab_size=64,
                            num_experts=3, moe_intermediate_size=32,
                            architectures=["Qwen3MoeForCausalLM"])
    with pytest.raises(ValueError, match=r"data_parallel_size 2 must divide num_experts \(3\)"):
        verify_with_parallel_config(cfg, 1, enable_expert_parallel=True, data_parallel_size=2)
    build_checkpoint(tmp_path, "llama")        # dense: plain data parallel, no group is joined
    config = Config(model=str(tmp_path), data_parallel_size=2, enable_expert_parallel=True)
    assert join_data_parallel_experts(config, 1, str(tmp_path / "never")) == (config, SINGLE)


def test_a_dummy_step_writes_no_kv_and_samples_nothing(oracle):
    """What a core with no work of its own runs under DP+EP (eagerly, as there)."""
    runner = ModelRunner(Config(model=oracle.path, num_kv_blocks=8, max_model_len=128,
                                enforce_eager=True, device="cpu"))
    for k, v in runner.kv_caches:
        k.normal_(), v.normal_()
    before = [(k.clone(), v.clone()) for k, v in runner.kv_caches]
    assert runner.execute_dummy_batch() is None
    for (k, v), (k0, v0) in zip(runner.kv_caches, before):
        assert torch.equal(k, k0) and torch.equal(v, v0)


@pytest.fixture(scope="module")
def oracle(tmp_path_factory):
    """A tiny Qwen3-MoE, 16 prompts, and the offline single engine's greedy text for each."""
    path = tmp_path_factory.mktemp("dp_ep_qwen3moe")
    build_checkpoint(path, "qwen3_moe", **MOE)
    prompts = [[(7 * i + 13 * j) % 380 + 1 for j in range(5 + i % 7)] for i in range(16)]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = LLM(str(path), **CONFIG).generate([{"prompt_token_ids": p} for p in prompts], params,
                                             progress=False)
    return SimpleNamespace(path=str(path), prompts=prompts, texts=[o.outputs[0].text for o in outs])


def test_dp2_ep_served_greedy_equals_offline_also_with_one_rank_idle(oracle):
    engine = AsyncLLM(oracle.path, data_parallel_size=2, enable_expert_parallel=True, **CONFIG)
    cores = [pid for role, pid in engine.engine_core.processes if role.startswith("engine core")]
    try:
        assert engine.engine_core.config.enforce_eager      # the exchange is not captured
        with serve(engine, "m") as url:
            # one request: one rank steps it, the other runs dummy steps to meet its exchanges
            assert concurrent_greedy(url, oracle.prompts[:1]) == oracle.texts[:1]
            assert concurrent_greedy(url, oracle.prompts) == oracle.texts
    finally:
        asyncio.run(engine.shutdown())
    wait_all_gone(cores)          # both cores stop, whichever was in the lockstep check


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads the process tree in /proc")
def test_dp2_ep_a_killed_rank_fails_every_stream_and_sigterm_stops_all(oracle):
    with serve_process(oracle.path, *EP, "--keep-alive-on-engine-death") as (proc, roles, url):
        assert roles.keys() == {"api server", "engine core 0", "engine core 1"}, roles
        tree = _descendants(proc.pid)
        body = {"model": "m", "prompt": [5, 6, 7], "max_tokens": 240, "stream": True,
                "ignore_eos": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as first, \
                httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as second:
            streams = [(line for line in r.iter_lines() if line) for r in (first, second)]
            assert all("error" not in next(stream) for stream in streams)   # both running
            os.kill(roles["engine core 1"], signal.SIGKILL)
            rests = [list(stream) for stream in streams]       # each ends, none hangs
        # Whichever the API server hears of first: rank 1 dead, or rank 0 out of lockstep
        dead = r"data-parallel rank (1|0: out of lockstep with the other data-parallel ranks)"
        for rest in rests:
            errors = [json.loads(line[len("data: "):])["error"] for line in rest if '"error"' in line]
            assert errors and re.search(dead, errors[0]["message"]), rest[-3:]
            assert rest[-1] == "data: [DONE]"
        health = httpx.get(url + "/health")
        assert health.status_code == 503 and re.search(dead, health.json()["error"]["message"])
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) in (0, -signal.SIGTERM)
        wait_all_gone(tree)
