"""test_quantization.py: `--quantization int8|fp8` (quantization.py, cpu/gemm.py, cuda/quantized.py).

  - every product path a backend can pick for a quantized Linear equals dequantize-then-F.linear
    (the Linear's torch reference) for 1, 7, 64 and 300 rows;
  - the built-in model keeps its quality: held-out perplexity within 3% (int8) / 5% (fp8) of bf16,
    and the same greedy story;
  - loading quantizes each slice as it is read: a TP rank's peak memory stays near its int8 shard;
  - TP=2 int8 greedy equals TP=1 int8; the errors are clear.

Run: pytest -q tests/test_quantization.py      (about a minute on 2 cores)
"""

import importlib.util
import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from conftest import build_checkpoint
from nanoserve import LLM, Config, SamplingParams
from nanoserve.cpu import kernels as cpu_kernels
from nanoserve.cpu.gemm import Int8KernelGemm, candidate_paths, make_gemm
from nanoserve.cuda.quantized import scaled_mm_linear, uses_scaled_mm
from nanoserve.layers import Linear
from nanoserve.model_runner import ModelRunner
from nanoserve.quantization import dequantize, quantize
from nanoserve.request import SchedulerOutput

ROOT = Path(__file__).resolve().parent.parent
ROWS = (1, 7, 64, 300)
needs_kernels = pytest.mark.skipif(cpu_kernels.load() is None, reason="no C compiler here")


def test_quantize_is_symmetric_per_output_channel():
    w = torch.randn(48, 40) * torch.linspace(0.01, 3, 48)[:, None]   # rows of very different size
    w[5] = 0                                                        # a row of zeros: no NaN
    for method, largest in (("int8", 127), ("fp8", 448)):
        q, scale = quantize(w, method)
        assert q.dtype == (torch.int8 if method == "int8" else torch.float8_e4m3fn) and scale.shape == (48,)
        assert torch.allclose(q.float().abs().amax(dim=1)[scale > 1e-9], torch.tensor(float(largest)))
        error = (dequantize(q, scale, torch.float32) - w).abs().amax(dim=1)
        # int8 rounds to the nearest step (half a scale); e4m3 keeps 3 bits of mantissa (1/16).
        bound = scale / 2 if method == "int8" else w.abs().amax(dim=1) / 16
        assert (error <= bound + 1e-7).all() and not error.isnan().any()


def quantized_paths(dtype, weight):
    """(name, gemm) for every product a CPU backend can pick for an int8 weight, both forms of the
    C product forced (in registers, widened panels), and the fp8 weight's widening path."""
    q, scale = quantize(weight, "int8")
    paths = [p for p in candidate_paths(torch.int8, dtype) if p != "kernel"]
    gemms = []
    for path in paths:
        try:
            gemms.append((path, make_gemm(path, q, None, scale, dtype), q, scale))
        except RuntimeError:   # _weight_int8pack_mm refuses bf16 with in_features % 32
            assert path == "int8pack" and dtype == torch.bfloat16 and weight.shape[1] % 32
    if cpu_kernels.load() is not None:
        for form, limit in (("registers", 1 << 30), ("panels", 0)):
            gemms.append((f"kernel-{form}", Int8KernelGemm(q, scale, None, dtype, register_rows=limit), q, scale))
    q8, scale8 = quantize(weight, "fp8")
    gemms.append(("fp8-widen", make_gemm("torch", q8, None, scale8, dtype), q8, scale8))
    return gemms


def assert_close_to_reference(y, x, q, scale, bias, dtype):
    """y == F.linear(x, dequantize(q, scale), bias) within the dtype's rounding: float32 sums in
    another order; bf16, also the reference's weights rounded to bf16 and the output's rounding."""
    ref = F.linear(x.float(), dequantize(q, scale, torch.float32), None if bias is None else bias.float())
    assert y.dtype == dtype and y.shape == ref.shape
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(y.float(), ref, atol=tol * ref.abs().max().item(), rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(64, 128), (96, 50), (67, 200), (1101, 40)])   # (in, out): ragged
# panels, an odd count of inputs, and over 512 (the integer form's sums move to float32 on the way)
def test_every_quantized_path_equals_dequantize_then_linear(dtype, shape):
    gen = torch.Generator().manual_seed(0)
    in_features, out_features = shape
    weight = torch.randn(out_features, in_features, generator=gen)
    names = set()
    for name, gemm, q, scale in quantized_paths(dtype, weight):
        names.add(name)
        for m in ROWS:
            x = torch.randn(m, in_features, generator=gen).to(dtype)
            assert_close_to_reference(gemm.product(x), x, q, scale, None, dtype)
    assert {"torch", "fp8-widen"} <= names
    assert cpu_kernels.load() is None or {"kernel-registers", "kernel-panels"} <= names


@needs_kernels
def test_int8_integer_products_cannot_overflow():
    """bf16 x in registers multiplies as int16 x int8 into int32 sums (gemm.c's integer form). The
    worst case, every x at the largest int16 its row takes and every q at 127, over 2,048 inputs,
    is 4x what an int32 holds: the sums must move to float32 in time (PAIRS_PER_SUM)."""
    k = 2048
    weight = torch.ones(40, k)
    weight[1::2] *= -1                                      # the other sign too
    q, scale = quantize(weight, "int8")
    x = torch.full((3, k), 1.9921875, dtype=torch.bfloat16)  # 1 + 127/128: 32,640 as int16
    x[1] *= -1
    gemm = Int8KernelGemm(q, scale, None, torch.bfloat16, register_rows=1 << 30)
    assert_close_to_reference(gemm.product(x), x, q, scale, None, torch.bfloat16)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_kernel_with_bias(dtype):
    """gemm_int8 with a bias, in both forms (in registers, widened panels)."""
    gen = torch.Generator().manual_seed(1)
    weight, bias = torch.randn(2 * 40, 64, generator=gen), torch.randn(2 * 40, generator=gen).to(dtype)
    q, scale = quantize(weight, "int8")
    for limit in (1 << 30, 0):
        gemm = Int8KernelGemm(q, scale, bias, dtype, register_rows=limit)
        for m in ROWS:
            x = torch.randn(m, 64, generator=gen).to(dtype)
            assert_close_to_reference(gemm.product(x), x, q, scale, bias, dtype)


@needs_kernels
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("form", ["registers", "panels"])
def test_replayed_int8_steps_equal_the_torch_reference(tmp_path, monkeypatch, dtype, form):
    """The CPU backend with every product on gemm_int8 == the model on its torch reference
    (dequantize, F.linear): the logits of a prefill (eager), and of a decode step after it,
    replayed from a capture."""
    from nanoserve.cpu import gemm
    build_checkpoint(tmp_path, "llama")
    monkeypatch.setattr(gemm, "int8_register_rows", lambda *shape: 1 << 30 if form == "registers" else 0)
    config = Config(model=str(tmp_path), dtype=dtype, quantization="int8", cpu_gemm="kernel", num_kv_blocks=32,
                    max_num_seqs=4)
    ours = ModelRunner(config)
    assert ours.backend.cudagraph_capture_sizes == [1, 2, 4]
    assert {p for label, p in ours.gemm_paths.items() if "int8" in label} == {"kernel"}
    record = [call.kernel for call in ours.backend.forward.graphs[1][0].record if call.kernel]
    assert "gemm_int8" in record
    monkeypatch.setenv("NANOSERVE_CPU_KERNEL", "0")
    reference = ModelRunner(config)
    assert reference.backend.name == "torch"
    tol = 1e-4 if dtype == "float32" else 3e-2
    for ids in (list(range(5, 45)), list(range(100, 103))):
        mine, ref = (logits_of(runner, ids[:-1]) for runner in (ours, reference))
        torch.testing.assert_close(mine, ref, atol=tol * ref.abs().max().item(), rtol=tol)
        mine, ref = (decode_logits(runner, ids) for runner in (ours, reference))
        torch.testing.assert_close(mine, ref, atol=tol * ref.abs().max().item(), rtol=tol)


def decode_logits(runner: ModelRunner, ids: list[int]) -> torch.Tensor:
    """The logits of a decode step of ids[-1] after logits_of(runner, ids[:-1]) filled the cache:
    a decode-only step, padded to a capture size (a replay where the backend captured one)."""
    table = list(range(-(-len(ids) // runner.block_size)))
    out = SchedulerOutput([SimpleNamespace(all_token_ids=ids, num_tokens=len(ids))], [1], [len(ids) - 1], [table])
    input_ids, positions, meta, logits_indices, _ = runner.prepare_inputs(out)
    hidden = runner.backend.forward(input_ids, positions, runner.kv_caches, runner.backend.build_metadata(meta))
    return runner.model.compute_logits(hidden[logits_indices]).float()


def test_fp8_scaled_mm_selection_and_product():
    """torch._scaled_mm only where the GPU multiplies fp8 (8.9+), in bf16, on multiples of 16; its
    product (per-token activation scales) runs on CPU too in this torch, so it is checked here."""
    linear = Linear(64, 32, bias=True, quantization="fp8")
    assert uses_scaled_mm(linear, (9, 0), torch.bfloat16) and uses_scaled_mm(linear, (8, 9), torch.bfloat16)
    assert not uses_scaled_mm(linear, (8, 0), torch.bfloat16)        # A100: no fp8 tensor cores
    assert not uses_scaled_mm(linear, (9, 0), torch.float16)         # row-wise scaling gives bf16 only
    assert not uses_scaled_mm(Linear(64, 40, False, "fp8"), (9, 0), torch.bfloat16)
    assert not uses_scaled_mm(Linear(64, 32, False, "int8"), (9, 0), torch.bfloat16)
    gen = torch.Generator().manual_seed(2)
    q, scale = quantize(torch.randn(32, 64, generator=gen), "fp8")
    linear.weight.data, linear.weight_scale, linear.bias.data = q, scale, torch.randn(32).bfloat16()
    for m in ROWS:
        x = torch.randn(m, 64, generator=gen).bfloat16()
        ref = linear.forward_native(x).float()
        # e4m3 activations: 3 bits of mantissa each, errors that mostly cancel over 64 products
        torch.testing.assert_close(scaled_mm_linear(linear, x).float(), ref, atol=0.1 * ref.abs().max().item(), rtol=0.1)


# -- the built-in model -------------------------------------------------------------------------

def held_out_docs(n: int = 40) -> list[str]:
    """The first n of the documents scripts/train_tiny_model.py held out (never trained on)."""
    spec = importlib.util.spec_from_file_location("train_tiny_model", ROOT / "scripts" / "train_tiny_model.py")
    script = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = script
    spec.loader.exec_module(script)
    args = json.loads((ROOT / "nanoserve/assets/nanoserve-tiny/training_report.json").read_text())["args"]
    docs = script.corpus(int(args["seed"]), int(args["docs"]))
    return docs[-max(1, len(docs) // 50):][:n]      # the script's split: the last 2%


@torch.inference_mode()
def logits_of(runner: ModelRunner, ids: list[int]) -> torch.Tensor:
    """Every position's logits [len(ids), vocab] (float32) of `ids` as one prefill through the
    runner's backend (its products are the quantized ones), in blocks 0, 1, ..."""
    table = list(range(-(-len(ids) // runner.block_size)))
    out = SchedulerOutput([SimpleNamespace(all_token_ids=ids, num_tokens=len(ids))], [len(ids)], [0], [table])
    input_ids, positions, meta, _, _ = runner.prepare_inputs(out)
    hidden = runner.backend.forward(input_ids, positions, runner.kv_caches, runner.backend.build_metadata(meta))
    return runner.model.compute_logits(hidden).float()


def perplexity(runner: ModelRunner, docs: list[list[int]]) -> float:
    """exp(mean next-token NLL) over every token after each document's first."""
    nll, count = 0.0, 0
    for ids in docs:
        ids = ids[:runner.config.max_model_len]
        logits = logits_of(runner, ids)[:-1]
        nll += F.cross_entropy(logits, torch.tensor(ids[1:], device=logits.device), reduction="sum").item()
        count += len(ids) - 1
    return math.exp(nll / count)


def test_builtin_model_perplexity_and_greedy_story():
    llms = {q: LLM("nanoserve-tiny", dtype="bfloat16", quantization=q, num_kv_blocks=64) for q in (None, "int8", "fp8")}
    docs = [llms[None].tokenizer(d, add_special_tokens=False).input_ids for d in held_out_docs()]
    ppl = {q: perplexity(llm.engine.executor.model_runner, docs) for q, llm in llms.items()}
    assert ppl[None] < 3.0, ppl                      # the model is trained: perplexity means something
    assert ppl["int8"] <= 1.03 * ppl[None] and ppl["fp8"] <= 1.05 * ppl[None], ppl
    params = SamplingParams(temperature=0.0, max_tokens=32)
    story = {q: llm.generate(["Once upon a time"], params, progress=False)[0].outputs[0].token_ids
             for q, llm in llms.items()}
    assert story["int8"] == story[None] and story["fp8"] == story[None]


# -- loading --------------------------------------------------------------------------------------

PEAK_SCRIPT = textwrap.dedent("""
    import json, sys, threading, time
    from pathlib import Path
    from transformers import AutoConfig
    from nanoserve.distributed import TensorParallel
    from nanoserve.model_loader import iterate_weights
    from nanoserve.models import LlamaForCausalLM

    def anon_rss():   # bytes of anonymous memory: the file pages safetensors maps are not ours
        for line in open("/proc/self/status"):
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024

    path, quantization = Path(sys.argv[1]), sys.argv[2] if sys.argv[2] != "none" else None
    model = LlamaForCausalLM(AutoConfig.from_pretrained(path), TensorParallel(rank=0, size=2), quantization)
    start, peak, done = anon_rss(), [0], threading.Event()
    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], anon_rss())
            time.sleep(0.0005)
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    model.load_weights(iterate_weights(path))
    done.set()
    sampler.join()
    held = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    print(json.dumps(dict(peak=max(peak[0], anon_rss()) - start, held=held)))
""")


def load_peak(path, quantization: str) -> dict:
    """Rank 0 of 2 loading `path` in a fresh process: how far its anonymous memory rose at most
    (sampled every 0.5 ms: a peak shorter than that may be missed), and the bytes it then holds.

    A fixed mmap threshold makes glibc map every large block and give it back when freed; by default
    the threshold grows with each freed block, so later tensors come from the heap and freed ones
    stay counted in RssAnon (CI saw 79 MB where the live bytes never exceeded ~41 MB)."""
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(128 * 1024)}
    out = subprocess.run([sys.executable, "-c", PEAK_SCRIPT, str(path), quantization],
                         capture_output=True, text=True, check=True, timeout=300, env=env)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_loading_int8_under_tp_never_holds_the_full_precision_shard(tmp_path):
    """Rank 0 of 2 loads a ~240 MB float32 checkpoint in int8: its memory grows by about its int8
    shard, plus one full-precision tensor in flight, never by its full-precision shard (which the
    same load without quantization shows it would otherwise hold)."""
    build_checkpoint(tmp_path, "llama", hidden_size=1024, intermediate_size=4096, num_hidden_layers=4,
                     num_attention_heads=8, num_key_value_heads=4)
    int8, unquantized = load_peak(tmp_path, "int8"), load_peak(tmp_path, "none")
    largest = 4096 * 1024 * 4                        # gate_proj in float32, whole (rank 0 reads half)
    bound = int8["held"] + largest + 16 * 2**20
    assert int8["peak"] < bound, (int8, bound)
    assert unquantized["peak"] > bound, (unquantized, bound)   # the check can fail: full precision exceeds it


def test_tp2_int8_greedy_equals_tp1_int8(tmp_path):
    build_checkpoint(tmp_path, "llama")
    prompts = [{"prompt_token_ids": list(range(3 + i, 40 + 7 * i))} for i in range(3)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outs = {}
    for tp in (1, 2):
        llm = LLM(str(tmp_path), quantization="int8", tensor_parallel_size=tp, num_kv_blocks=64,
                  max_model_len=256)
        outs[tp] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, progress=False)]
        del llm
    assert outs[1] == outs[2]


# -- errors -----------------------------------------------------------------------------------------

def test_unknown_method_is_a_clear_error():
    with pytest.raises(ValueError, match="quantization must be one of int8, fp8"):
        Config(quantization="int4")
    run = subprocess.run([sys.executable, "-m", "nanoserve.cli", "memory", "--quantization", "gptq"],
                         capture_output=True, text=True)
    assert run.returncode != 0 and "--quantization: invalid choice" in run.stderr


def test_an_already_quantized_checkpoint_is_refused(tmp_path):
    build_checkpoint(tmp_path, "llama")
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    (tmp_path / "config.json").write_text(json.dumps(config))
    for quantization in (None, "int8"):
        with pytest.raises(ValueError, match="already quantized.*'gptq'"):
            LLM(str(tmp_path), quantization=quantization, num_kv_blocks=16)


def test_fp8_where_torch_cannot_hold_it(monkeypatch):
    from nanoserve import quantization
    monkeypatch.delattr(torch, "float8_e4m3fn")      # a torch without the dtype
    with pytest.raises(ValueError, match="quantization 'fp8': torch .* cannot hold float8_e4m3fn"):
        quantization.check_quantization("fp8", SimpleNamespace(), torch.device("cpu"))


@pytest.mark.parametrize("tie", [False, True])
def test_quantize_lm_head_quantizes_the_head_from_its_own_or_the_tied_weights(tmp_path, tie):
    """--quantize-lm-head (llama.cpp's quantized output tensor, opt-in): the LM head is an int8
    Linear, read from the checkpoint's lm_head.weight, or from the embedding it is tied to (which
    stays in the model dtype for its lookups); its logits are those of the dequantized head."""
    hf = build_checkpoint(tmp_path, "llama", tie=tie)
    config = Config(model=str(tmp_path), quantization="int8", quantize_lm_head=True, num_kv_blocks=32,
                    enforce_eager=True)
    runner = ModelRunner(config)
    head, embed = runner.model.lm_head, runner.model.model.embed_tokens
    assert head.quantization == "int8" and head.weight is not embed.weight
    assert embed.weight.dtype == torch.float32
    source = (hf.get_input_embeddings() if tie else hf.lm_head).weight.detach()
    q, scale = quantize(source, "int8")
    assert torch.equal(runner.model.lm_head.weight_scale, scale)
    hidden = torch.randn(3, source.shape[1])
    with torch.inference_mode():
        logits = runner.model.compute_logits(hidden)
    expected = F.linear(hidden, dequantize(q, scale, torch.float32))
    torch.testing.assert_close(logits.float(), expected, atol=1e-4 * expected.abs().max().item(), rtol=1e-4)
    with pytest.raises(ValueError, match="quantize_lm_head needs --quantization"):
        Config(quantize_lm_head=True)
