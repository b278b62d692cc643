"""bench.py: `nanoserve bench`, the standard offline throughput workload, and how close it runs
to the machine's limit.

    nanoserve bench                              # SmolLM2-135M-shaped random weights, float32
    nanoserve bench --dtype bfloat16 --num-prompts 16 --output-len 32 64

The default workload (the one scripts/bench_offline.py and scripts/compare_vllm.py run):
64 requests, prompt lengths uniform in [32, 512], output lengths uniform in [32, 256],
random token ids (seed 0), greedy, ignore_eos, on random weights with SmolLM2-135M's shape.
It prints output tokens/s, the mean batch size, where each step's time went, and the
model's useful FLOP/s as a fraction of this machine's matmul peak, measured in the same
run with the same dtype, threads and GEMM path (the one cpu/gemm.py chose at start-up, on
the model's own layer shapes): the fraction says how much speed is left to find.
"""

from __future__ import annotations

import os
import random
import time
from pathlib import Path

import torch

from nanoserve.sampling_params import SamplingParams

SMOLLM2_135M = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                    num_attention_heads=9, num_key_value_heads=3, vocab_size=49152,
                    max_position_embeddings=2048, rms_norm_eps=1e-5, tie_word_embeddings=True,
                    architectures=["LlamaForCausalLM"])
DEFAULT_CHECKPOINT = Path("/tmp/nanoserve-bench-smollm2-135m")
# A mixture of experts of the same width (scripts/compare_vllm.py --moe): Qwen3-MoE's layers with 16
# experts of 384, 4 a token, so that a token's MLP work (4 x 384 = 1536) is SmolLM2-135M's.
QWEN3_MOE_AT_SMOLLM2 = dict(SMOLLM2_135M, architectures=["Qwen3MoeForCausalLM"], head_dim=64,
                            num_experts=16, num_experts_per_tok=4, moe_intermediate_size=384,
                            norm_topk_prob=True)
MOE_CHECKPOINT = Path("/tmp/nanoserve-bench-qwen3moe-16x384")


def make_checkpoint(path: Path = DEFAULT_CHECKPOINT, shape: dict = SMOLLM2_135M) -> Path:
    """Random weights of `shape` (SmolLM2-135M's) plus a word-level tokenizer, saved once, loaded
    by the real loader (no hub needed)."""
    if (path / "model.safetensors").is_file():
        return path
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast
    torch.manual_seed(0)
    model_type = "qwen3_moe" if shape["architectures"] == ["Qwen3MoeForCausalLM"] else "llama"
    AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **shape)).save_pretrained(path)
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(SMOLLM2_135M["vocab_size"])},
                                     unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="t0").save_pretrained(path)
    return path


def make_workload(num_prompts: int = 64, input_len=(32, 512), output_len=(32, 256),
                  vocab_size: int = SMOLLM2_135M["vocab_size"], seed: int = 0):
    """(prompts as token id lists, output lengths): the same for every engine, given the seed."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(vocab_size) for _ in range(rng.randint(*input_len))]
               for _ in range(num_prompts)]
    return prompts, [rng.randint(*output_len) for _ in range(num_prompts)]


def layer_weights(hf_config) -> int:
    """Weights a token multiplies by in one decoder layer: the q, k, v and o projections and the
    MLP's three; in a mixture of experts, the router's and its top-k experts' three each (every
    layer counted sparse: Qwen3-MoE's few dense mlp_only_layers are not told apart)."""
    from nanoserve.models import get_head_size, get_moe_shape, get_total_num_kv_heads
    h, heads, head_dim = hf_config.hidden_size, hf_config.num_attention_heads, get_head_size(hf_config)
    kv = get_total_num_kv_heads(hf_config) * head_dim
    mlp = 3 * h * hf_config.intermediate_size
    if moe := get_moe_shape(hf_config):
        experts, top_k, width = moe
        mlp = h * experts + top_k * 3 * h * width
    return h * (heads * head_dim + 2 * kv) + heads * head_dim * h + mlp


def useful_flops(hf_config, prompts, output_lens) -> float:
    """FLOPs the workload needs at the least: 2 per weight per token through the layers, the
    LM head once per output token, and QK^T + PV attention over each token's context
    (recomputation after preemption does not count)."""
    from nanoserve.models import get_head_size
    h, layers, heads = hf_config.hidden_size, hf_config.num_hidden_layers, hf_config.num_attention_heads
    head_dim, per_layer = get_head_size(hf_config), layer_weights(hf_config)
    total = 0.0
    for prompt, out in zip(prompts, output_lens):
        fed = len(prompt) + out - 1                  # the last sampled token is never fed back
        total += 2 * per_layer * layers * fed + 2 * h * hf_config.vocab_size * out
        total += 4 * layers * heads * head_dim * fed * (fed + 1) / 2
    return total


def matmul_peak(runner) -> tuple[float, str]:
    """`runner`: an executor or a ModelRunner (worker.py's RunnerInfo attributes).
    (FLOP/s, path): the best sustained rate of 512-row products over the model's own layer
    shapes (this rank's, under tensor parallel), along the path its layers use most (chosen per
    shape at start-up on CPU, cpu/gemm.py; F.linear, i.e. cuBLAS, on CUDA). The LM head is left
    out: it only ever multiplies the rows that sample."""
    from collections import Counter

    from nanoserve.cpu.gemm import gemm_peak
    path = Counter(runner.gemm_paths.values()).most_common(1)[0][0]
    shapes = {tuple(map(int, label.split()[0].split("x"))) for label in runner.gemm_paths}
    head_rows = -(-runner.vocab_size // runner.config.tensor_parallel_size)
    shapes = [(i, o) for i, o in shapes if o != head_rows] or list(shapes)
    quantization = runner.config.quantization   # the layers' paths multiply quantized weights
    return gemm_peak(path, runner.dtype, shapes, device=runner.device.type, quantization=quantization), path


def cpu_description() -> str:
    """lscpu's model name and its SIMD flags: a figure means little without the machine it
    ran on (the fastest GEMM path differs between CPUs)."""
    import platform
    import subprocess
    try:
        fields = dict(line.split(":", 1) for line in subprocess.run(
            ["lscpu"], capture_output=True, text=True, check=True).stdout.splitlines() if ":" in line)
    except (OSError, subprocess.CalledProcessError):
        return platform.processor() or platform.machine()
    flags = [f for f in fields.get("Flags", "").split() if f.startswith(("avx", "amx", "fma"))]
    return f"{fields.get('Model name', '?').strip()}, {os.cpu_count()} cpus, flags: {' '.join(flags)}"


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def make_bench_llm(model: str | None = None, dtype: str = "float32", **config):
    """The engine the workload runs on (default: the SmolLM2-135M-shaped checkpoint), warmed up
    with one short request so that no timed run pays for first-call set-up."""
    from nanoserve.engine import LLM
    config = {"kv_cache_memory_gb": 4, "max_model_len": 1024, **config}
    llm = LLM(model or str(make_checkpoint()), dtype=dtype, **config)
    llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=4), progress=False)
    return llm


def time_workload(llm, prompts, output_lens) -> dict:
    """One timed run of the workload on `llm`: throughput, steps and where each step's time went."""
    engine = llm.engine
    engine.timings.update(dict.fromkeys(engine.timings, 0.0))
    steps_before, batched_before = engine.scheduler.num_steps, engine.num_batched_requests
    spec_before = dict(engine.scheduler.spec_counts)
    params = [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=n) for n in output_lens]
    elapsed = _timed(lambda: llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                          progress=False))
    steps = engine.scheduler.num_steps - steps_before
    flops = useful_flops(engine.executor.hf_config, prompts, output_lens)
    return {"requests": len(prompts), "prompt_tokens": sum(map(len, prompts)),
            "output_tokens": sum(output_lens), "elapsed_s": elapsed,
            "output_tok_s": sum(output_lens) / elapsed, "steps": steps,
            "mean_batch_size": (engine.num_batched_requests - batched_before) / steps,
            "ms_per_step": {k: 1e3 * v / steps for k, v in engine.timings.items()},
            "model_flop_s": flops / elapsed,
            "dtype": str(engine.executor.dtype).removeprefix("torch."),
            "gemm_paths": engine.executor.gemm_paths,
            "threads": torch.get_num_threads(),
            "spec_decode": spec_decode_summary(engine, spec_before)}


def spec_decode_summary(engine, before: dict) -> dict | None:
    """Speculative decoding over the run (None when it is off): draft tokens, accepted ones,
    the acceptance rate, and the mean tokens gained per verifying step (accepted + bonus)."""
    if engine.scheduler.proposer is None:
        return None
    counts = {k: v - before[k] for k, v in engine.scheduler.spec_counts.items()}
    drafts, accepted = counts["num_draft_tokens"], counts["num_accepted_tokens"]
    return {**counts, "acceptance_rate": accepted / drafts if drafts else 0.0,
            "mean_tokens_per_draft_step": 1 + accepted / max(counts["num_drafts"], 1)}


def run_bench(model: str | None = None, num_prompts: int = 64, input_len=(32, 512),
              output_len=(32, 256), dtype: str = "float32", **config) -> dict:
    """The workload, once, on a fresh engine (so nothing is in its prefix cache)."""
    llm = make_bench_llm(model, dtype, **config)
    prompts, output_lens = make_workload(num_prompts, input_len, output_len,
                                         llm.engine.executor.vocab_size)
    return time_workload(llm, prompts, output_lens)


def main(model=None, num_prompts=64, input_len=(32, 512), output_len=(32, 256),
         dtype="float32", **config) -> dict:
    from rich.console import Console
    from rich.table import Table
    llm = make_bench_llm(model, dtype, **config)
    prompts, output_lens = make_workload(num_prompts, tuple(input_len), tuple(output_len),
                                         llm.engine.executor.vocab_size)
    result = time_workload(llm, prompts, output_lens)
    peak, path = matmul_peak(llm.engine.executor)
    table = Table(title=f"nanoserve bench: {result['requests']} requests, {result['dtype']}, "
                        f"{result['threads']} threads")
    table.add_column("metric")
    table.add_column("value", justify="right")
    rows = [("machine", cpu_description()), ("output tokens/s", f"{result['output_tok_s']:.1f}"),
            ("prompt / output tokens", f"{result['prompt_tokens']} / {result['output_tokens']}"),
            ("elapsed", f"{result['elapsed_s']:.1f} s"), ("steps", str(result["steps"])),
            ("mean batch size", f"{result['mean_batch_size']:.1f} requests/step")]
    if (spec := result["spec_decode"]) is not None:
        rows += [("spec decode acceptance rate", f"{spec['acceptance_rate']:.2f} "
                  f"({spec['num_accepted_tokens']} of {spec['num_draft_tokens']} draft tokens, "
                  f"{spec['mean_tokens_per_draft_step']:.2f} tokens per verifying step)")]
    rows += [(f"ms/step: {k}", f"{v:.2f}") for k, v in result["ms_per_step"].items()]
    rows += [("model FLOP/s", f"{result['model_flop_s'] / 1e9:.1f} GFLOP/s"),
             ("GEMM path per shape", ", ".join(f"{k}: {v}" for k, v in result["gemm_paths"].items())),
             (f"matmul peak, {path} (same run)", f"{peak / 1e9:.1f} GFLOP/s"),
             ("fraction of peak", f"{result['model_flop_s'] / peak:.2f}")]
    for row in rows:
        table.add_row(*row)
    Console().print(table)
    return {**result, "matmul_peak_flop_s": peak, "matmul_peak_path": path}
