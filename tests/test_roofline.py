"""test_roofline.py: scripts/roofline.py reads the steps a traced run really took, and its
bound is the arithmetic its docstring shows.

Run: pytest -q tests/test_roofline.py      (a few seconds)
"""

import importlib.util
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from conftest import build_checkpoint
from nanoserve.engine import LLM
from nanoserve.sampling_params import SamplingParams

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("roofline", ROOT / "scripts" / "roofline.py")
roofline = importlib.util.module_from_spec(spec)
spec.loader.exec_module(roofline)

SMOLLM2_SHAPE = SimpleNamespace(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                                num_attention_heads=9, num_key_value_heads=3, vocab_size=49152)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("model")
    build_checkpoint(path)
    return str(path)


@pytest.mark.parametrize("setup", ["roomy", "preempt"])
def test_traced_steps_are_the_engine_steps(model_path, tmp_path, setup):
    """Oracle: the engine's own counts. Every prompt token and every fed-back output token is
    scheduled once, plus what preemption makes the engine compute again; each output token is
    one sampling row; the longest request holds prompt + output - 1 tokens at the end. Prompts
    longer than the token budget are chunked."""
    trace = tmp_path / "run.jsonl"
    blocks = dict(num_kv_blocks=12, max_model_len=160) if setup == "preempt" else {}
    llm = LLM(model_path, trace=str(trace), max_num_batched_tokens=64, max_num_seqs=4,
              enable_prefix_caching=False, **blocks)
    prompts = [list(range(1, 1 + n)) for n in (100, 7, 30, 65, 12)]
    outputs = [5, 9, 1, 3, 30]
    llm.generate([{"prompt_token_ids": p} for p in prompts],
                 [SamplingParams(max_tokens=n, ignore_eos=True) for n in outputs], progress=False)
    lines = trace.read_text().splitlines()
    recomputed = sum(json.loads(line).get("num_computed_tokens", 0) for line in lines
                     if json.loads(line)["ev"] == "preempt")
    assert (recomputed > 0) == (setup == "preempt")
    steps = roofline.traced_steps(lines)
    assert len(steps) == llm.engine.scheduler.num_steps
    fed = sum(len(p) + o - 1 for p, o in zip(prompts, outputs))
    assert sum(n for step in steps for n, _, _ in step) == fed + recomputed
    assert sum(samples for step in steps for _, _, samples in step) == sum(outputs)
    assert all(sum(n for n, _, _ in step) <= 64 for step in steps)
    assert max(seq for step in steps for _, seq, _ in step) == max(len(p) + o - 1 for p, o in zip(prompts, outputs))

def test_lower_bound_of_the_worked_example():
    """The docstring's step: 64 decodes of 300 cached tokens, bench model, bf16, 430 GFLOP/s,
    30 GB/s: linears 31.6 ms (compute), K/V 14.7 ms (memory), LM head 8.4 ms (compute)."""
    step = [(1, 301, True)] * 64   # one new token each, 300 cached before the step
    parts = roofline.lower_bound([step], SMOLLM2_SHAPE, torch.bfloat16, peak=430e9, bandwidth=30e9)
    assert parts["linears"] == pytest.approx(2 * 106_168_320 * 64 / 430e9)   # 31.6 ms
    assert parts["attention"] == pytest.approx(64 * 300 * 30 * 768 / 30e9)    # 442 MB: 14.7 ms
    assert parts["LM head"] == pytest.approx(2 * 576 * 49152 * 64 / 430e9)
    # A step of only unfinished prompt chunks samples nothing: no LM head, and linears at peak.
    chunk = roofline.lower_bound([[(2048, 2048, False)]], SMOLLM2_SHAPE, torch.bfloat16, 430e9, 30e9)
    assert chunk["LM head"] == 0.0
    assert chunk["linears"] == pytest.approx(2 * 106_168_320 * 2048 / 430e9)
