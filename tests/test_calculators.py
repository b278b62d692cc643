"""`nanoserve memory` and `nanoserve cost`: the KV formula against hand-computed values for real
model shapes, the calculator against the engine's own allocation, the cost arithmetic on a
worked example, and clear errors for bad input."""

import json
import math
import shutil
from pathlib import Path

import pytest
import torch

from conftest import build_checkpoint
from nanoserve import LLM
from nanoserve.cli import main as cli
from nanoserve.layers import Linear
from nanoserve.tools.cost import CostInputs, cost_inputs, plot_cost
from nanoserve.tools.memory import memory_report
from nanoserve.tools.memory_plot import plot_memory

GiB = 2**30
ROOT = Path(__file__).resolve().parent.parent

# The published shapes (config.json of meta-llama/Meta-Llama-3-8B and Qwen/Qwen3-0.6B).
LLAMA3_8B = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=4096,
                 intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                 num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192,
                 rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=False,
                 hidden_act="silu", torch_dtype="bfloat16")
QWEN3_06B = dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_size=1024,
                 intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                 num_key_value_heads=8, head_dim=128, vocab_size=151936,
                 max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000.0,
                 tie_word_embeddings=True, hidden_act="silu", torch_dtype="bfloat16")


def write_config(tmp_path, cfg) -> str:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    return str(path)


# -- memory: hand-computed -------------------------------------------------------------------
@pytest.mark.parametrize("cfg, kv_per_token, num_params", [
    (LLAMA3_8B, 2 * 32 * 8 * 128 * 2, 8_030_261_248),   # 131,072 B; Meta's "8.03B"
    (QWEN3_06B, 2 * 28 * 8 * 128 * 2, 596_049_920),     # 114,688 B; tied: 0.6B, 0.44B non-embedding
])
def test_kv_formula_and_weights_match_hand_computed(tmp_path, cfg, kv_per_token, num_params):
    r = memory_report(write_config(tmp_path, cfg), device_memory_gb=80, dtype="bfloat16",
                      activation_reserve_gb=2, max_model_len=8192)
    assert r.kv_bytes_per_token == kv_per_token
    assert r.num_params == num_params and r.params_from == "config.json"
    # RoPE tables: cos and sin, [max_position, head_dim / 2] each, float32.
    assert r.buffer_bytes == cfg["max_position_embeddings"] * 128 * 4
    weights = num_params * 2 + r.buffer_bytes
    budget = 80 * GiB * 0.9 - weights - 2 * GiB
    assert r.weight_bytes == weights and r.kv_budget_bytes == pytest.approx(budget)
    assert r.num_blocks == int(budget // (kv_per_token * 16))
    assert r.num_seqs == r.num_blocks // (8192 // 16)


def test_worked_examples_in_the_docs():
    """memory.py's (80 GiB) and the README's (24 and 18 GiB) numbers, from the shipped config."""
    path = str(ROOT / "examples" / "llama-3-8b-config.json")
    assert json.loads(Path(path).read_text()) | LLAMA3_8B == json.loads(Path(path).read_text())
    for gb, blocks, tokens, seqs in ((80, 28924, 462784, 56), (24, 3119, 49904, 6)):
        r = memory_report(path, device_memory_gb=gb, max_model_len=8192)
        assert (r.num_blocks, r.num_blocks * r.block_size, r.num_seqs) == (blocks, tokens, seqs)
    readme = (ROOT / "README.md").read_text()
    assert "3,119" in readme and "49,904" in readme
    assert memory_report(path, device_memory_gb=18).num_blocks * 16 == 5664 and "5664" in readme


def test_tensor_parallel_and_kv_dtype_are_per_gpu(tmp_path):
    path = write_config(tmp_path, LLAMA3_8B)
    one = memory_report(path, device_memory_gb=80, activation_reserve_gb=1)
    two = memory_report(path, device_memory_gb=80, activation_reserve_gb=1, tensor_parallel_size=2)
    assert two.num_kv_heads == 4 and two.kv_bytes_per_token == one.kv_bytes_per_token // 2
    assert two.weight_bytes == one.weight_bytes / 2
    # More GPUs than KV heads: each keeps one (a replica), so bytes per token stop shrinking.
    sixteen = memory_report(path, device_memory_gb=80, tensor_parallel_size=16)
    assert sixteen.num_kv_heads == 1 and sixteen.kv_bytes_per_token == 2 * 32 * 128 * 2
    fp8 = memory_report(path, device_memory_gb=80, activation_reserve_gb=1, kv_cache_dtype="fp8")
    assert fp8.kv_bytes_per_token == 2 * 32 * 8 * 128 * 1
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        memory_report(path, device_memory_gb=80, tensor_parallel_size=3)


def test_verdicts(tmp_path):
    path = write_config(tmp_path, LLAMA3_8B)
    assert memory_report(path, device_memory_gb=16).kv_budget_bytes < 0   # 16 GB of weights
    small = memory_report(path, device_memory_gb=18, activation_reserve_gb=0.5, max_model_len=8192)
    assert 0 < small.num_blocks < 512 and small.num_seqs == 0
    from nanoserve.tools.memory import verdict
    assert f"largest max_model_len that fits is {small.num_blocks * 16}" in verdict(small)
    assert verdict(memory_report(path, device_memory_gb=16)).startswith("does not fit")


# -- memory: the calculator agrees with the engine -------------------------------------------
@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    model = build_checkpoint(path, "llama")
    return str(path), model


@pytest.mark.parametrize("dtype, gb", [("auto", 0.0013), ("bfloat16", 0.0007)])
def test_calculator_block_count_equals_the_engines(tiny, dtype, gb):
    path, hf_model = tiny
    # Forced to keep weights in the model dtype (auto may pick bf16 weights packed in float32).
    llm = LLM(path, dtype=dtype, kv_cache_memory_gb=gb, block_size=8, cpu_gemm="onednn")
    r = memory_report(path, dtype=dtype, kv_cache_memory_gb=gb, block_size=8)
    assert r.num_blocks == llm.engine.config.num_kv_blocks > 0
    assert r.max_model_len == llm.engine.config.max_model_len
    # Weights: what the engine holds (parameters + buffers), counted from the headers.
    model = llm.engine.executor.model_runner.model
    held = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    held += sum(m.impl.__self__.nbytes for m in model.modules()   # what each Linear's gemm holds
                if isinstance(m, Linear) and m.weight is None)   # in place of its weight
    assert r.weight_bytes == held and r.params_from == "safetensors headers"
    assert r.num_params == hf_model.num_parameters()


@pytest.mark.parametrize("arch", ["llama", "qwen3-tied"])
def test_headers_and_config_count_the_same_parameters(tiny, tmp_path, arch):
    path = tiny[0]
    if arch == "qwen3-tied":
        path = str(tmp_path / "ckpt")
        hf_model = build_checkpoint(path, "qwen3", tie=True)
        # Some tied checkpoints store lm_head.weight anyway; the engine's loader skips it.
        from safetensors.torch import load_file, save_file
        tensors = load_file(Path(path) / "model.safetensors")
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
        save_file(tensors, Path(path) / "model.safetensors")
        assert memory_report(path, kv_cache_memory_gb=1).num_params == hf_model.num_parameters()
    (tmp_path / "bare").mkdir()
    shutil.copy(Path(path) / "config.json", tmp_path / "bare")   # no weights beside it
    from_config = memory_report(str(tmp_path / "bare" / "config.json"), kv_cache_memory_gb=1)
    assert from_config.params_from == "config.json"
    assert from_config.num_params == memory_report(path, kv_cache_memory_gb=1).num_params


def test_memory_bad_input(tmp_path, tiny):
    with pytest.raises(ValueError, match="device_memory_gb"):
        memory_report(tiny[0], device_memory_gb=-1)
    with pytest.raises(ValueError, match="block_size"):
        memory_report(tiny[0], block_size=0)
    with pytest.raises(ValueError, match="activation_reserve_gb"):
        memory_report(tiny[0], device_memory_gb=8, activation_reserve_gb=-1)
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        memory_report(tiny[0], kv_cache_dtype="int3")
    with pytest.raises(ValueError, match="config.json"):
        memory_report(str(tmp_path))                                     # a directory without one
    with pytest.raises(ValueError, match="config.json"):
        memory_report(str(tmp_path / "missing.json"))


def test_memory_cli_and_plot(tiny, tmp_path, capsys):
    png = tmp_path / "memory.png"
    cli(["memory", tiny[0], "--kv-cache-memory-gb", "0.0013", "--block-size", "8",
         "--plot", str(png)])
    blocks = memory_report(tiny[0], kv_cache_memory_gb=0.0013, block_size=8).num_blocks
    out = capsys.readouterr().out
    assert f"{blocks:,}" in out and "fits" in out
    assert png.read_bytes()[:4] == b"\x89PNG"
    with pytest.raises(SystemExit, match="device_memory_gb must be > 0"):
        cli(["memory", tiny[0], "--device-memory-gb", "-2"])
    with pytest.raises(SystemExit, match="neither a checkpoint directory nor a config.json"):
        cli(["memory", str(tmp_path / "nowhere")])


def test_plot_memory_when_nothing_fits(tmp_path):
    r = memory_report(write_config(tmp_path, LLAMA3_8B), device_memory_gb=16)
    plot_memory(r, str(tmp_path / "m.png"))
    assert (tmp_path / "m.png").stat().st_size > 0


# -- cost ------------------------------------------------------------------------------------
WORKED = dict(requests_per_day=100_000, prompt_tokens=1000, output_tokens=200,
              api_input_price=0.15, api_output_price=0.60, gpu_price_per_hour=2.0,
              throughput=1000)


def test_cost_worked_example():
    c = CostInputs(**WORKED)
    assert c.api_cost_per_request == pytest.approx((1000 * 0.15 + 200 * 0.60) / 1e6)  # $0.00027
    assert c.api_monthly() == pytest.approx(810.0)              # 100k x 30 x 0.00027
    assert c.self_hosted_monthly() == pytest.approx(1440.0)     # $2 x 24 h x 30 days
    assert c.capacity_per_day == pytest.approx(432_000)         # 1000 / 200 x 86,400
    assert c.break_even == pytest.approx(1440 / (30 * 0.00027))  # 177,777.8 requests/day
    assert c.break_even / c.capacity_per_day == pytest.approx(0.41152, abs=1e-5)
    assert c.utilisation() == pytest.approx(100_000 / 432_000)
    # Past one server's capacity a second one is paid for in full.
    assert c.servers(1_000_000) == 3 and c.self_hosted_monthly(1_000_000) == pytest.approx(4320)
    assert c.utilisation(1_000_000) == pytest.approx(1_000_000 / (3 * 432_000))
    # A server that, fully busy, still costs more than the API never breaks even.
    assert CostInputs(**{**WORKED, "throughput": 100}).break_even is None


def test_prices_file_is_dated_and_flags_win(tmp_path):
    shipped = json.loads((ROOT / "examples" / "prices.json").read_text())
    for section in ("api", "gpu"):
        assert shipped[section]["as_of"] and shipped[section]["source"]
    workload = {k: WORKED[k] for k in ("requests_per_day", "prompt_tokens", "output_tokens",
                                       "throughput")}
    c, notes = cost_inputs(str(ROOT / "examples" / "prices.json"), **workload,
                           gpu_price_per_hour=1.25, api_input_price=None)
    assert c.gpu_price_per_hour == 1.25
    assert c.api_input_price == shipped["api"]["input_per_million_tokens"]
    assert len(notes) == 1 and shipped["api"]["as_of"] in notes[0]      # only the file's api entry
    readme_example = CostInputs(**{**WORKED, "gpu_price_per_hour": shipped["gpu"]["per_hour"],
                                   "api_input_price": shipped["api"]["input_per_million_tokens"],
                                   "api_output_price": shipped["api"]["output_per_million_tokens"]})
    assert f"{readme_example.break_even:,.0f} req/day" in (ROOT / "README.md").read_text()
    with pytest.raises(ValueError, match="api_output_price"):
        cost_inputs(None, **workload, api_input_price=0.1, gpu_price_per_hour=2.0)


def test_cost_bad_input_and_cli(tmp_path, capsys):
    for field, value in (("requests_per_day", -1), ("throughput", 0), ("api_input_price", -0.1),
                         ("output_tokens", 0), ("gpu_price_per_hour", math.nan)):
        with pytest.raises(ValueError, match=field):
            CostInputs(**{**WORKED, field: value})
    with pytest.raises(ValueError, match="prices"):
        cost_inputs(str(tmp_path / "missing.json"))
    args = [f"--{k.replace('_', '-')}={v}" for k, v in WORKED.items()]
    png = tmp_path / "cost.png"
    cli(["cost", *args, "--plot", str(png)])
    out = capsys.readouterr().out
    assert "$810.00" in out and "$1,440.00" in out and "177,778 req/day" in out
    assert png.read_bytes()[:4] == b"\x89PNG"
    with pytest.raises(SystemExit, match="requests_per_day must be >= 0"):
        cli(["cost", *args, "--requests-per-day=-5"])


def test_plot_cost_without_break_even(tmp_path):
    plot_cost(CostInputs(**{**WORKED, "throughput": 100}), str(tmp_path / "c.png"))
    assert (tmp_path / "c.png").stat().st_size > 0


def test_memory_takes_a_hugging_face_id_and_fetches_only_its_config(monkeypatch):
    """`nanoserve memory Org/Name`: config.json alone comes from the hub (never a weight file), and
    the figures are those of the same config.json read locally."""
    import huggingface_hub
    shipped = str(Path(__file__).resolve().parent.parent / "examples" / "llama-3-8b-config.json")
    fetched = []

    def fake_download(repo_id, filename, **kwargs):
        fetched.append((repo_id, filename))
        return shipped
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", fake_download)
    by_id = memory_report("meta-llama/Meta-Llama-3-8B", device_memory_gb=80, max_model_len=8192)
    assert fetched == [("meta-llama/Meta-Llama-3-8B", "config.json")]
    local = memory_report(shipped, device_memory_gb=80, max_model_len=8192)
    assert (by_id.num_blocks, by_id.num_params) == (local.num_blocks, local.num_params)

    def offline(repo_id, filename, **kwargs):
        raise huggingface_hub.errors.LocalEntryNotFoundError("cannot reach the hub (offline)")
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", offline)
    with pytest.raises(ValueError, match="could not be fetched from the Hugging Face hub.*offline"):
        memory_report("Qwen/Qwen3-30B-A3B")


def test_memory_counts_a_mixture_of_experts_total_and_active_parameters():
    """The shipped Qwen3-30B-A3B and Mixtral-8x7B configs, counted by hand: a token uses every
    parameter but the experts it is not routed to (E - top_k of E, in each MoE layer)."""
    examples = Path(__file__).resolve().parent.parent / "examples"
    h, q, kv, hd, layers, v = 2048, 32, 4, 128, 48, 151936          # Qwen3-30B-A3B
    attention = h * q * hd * 2 + h * kv * hd * 2 + 2 * hd           # q, o, k, v; q/k norms
    expert, e, k = 3 * h * 768, 128, 8
    total = layers * (attention + 2 * h + h * e + e * expert) + 2 * v * h + h
    r = memory_report(str(examples / "qwen3-30b-a3b-config.json"), device_memory_gb=80)
    assert (r.num_params, r.active_params) == (total, total - layers * (e - k) * expert)
    assert (r.num_params, r.active_params) == (30_532_122_624, 3_353_032_704)   # "30B-A3B"
    h, layers, v, expert, e, k = 4096, 32, 32000, 3 * 4096 * 14336, 8, 2     # Mixtral-8x7B
    mixtral = str(examples / "mixtral-8x7b-config.json")
    r = memory_report(mixtral, device_memory_gb=80, tensor_parallel_size=2, enable_expert_parallel=True)
    assert r.num_params - r.active_params == layers * (e - k) * expert
    assert (round(r.num_params / 1e9, 1), round(r.active_params / 1e9, 1)) == (46.7, 12.9)
    assert r.experts.startswith("4 of 8 whole experts per GPU") and r.weight_bytes < 47e9
    assert memory_report(mixtral, device_memory_gb=80).active_params == r.active_params
    assert memory_report(str(examples / "llama-3-8b-config.json"), device_memory_gb=80).active_params is None
    with pytest.raises(ValueError, match="enable_expert_parallel: tensor_parallel_size 16 must divide"):
        memory_report(mixtral, device_memory_gb=80, tensor_parallel_size=16, enable_expert_parallel=True)


def test_activation_estimate_holds_a_mixture_of_experts_block():
    """The profile's estimate covers what the fused MoE form holds at once for n tokens: the
    three caches of its n x top_k (token, expert) pairs (gate_up [2W], silu·mul [W], output
    [hidden]: vLLM's intermediate_cache1..3); the dense MLP's width would fall short. Under
    expert parallel a rank may get every pair at the expert's whole width."""
    from transformers import AutoConfig
    from nanoserve.model_loader import estimate_activation_bytes, kv_cache_bytes_per_token
    cfg = AutoConfig.from_pretrained(ROOT / "examples" / "qwen3-30b-a3b-config.json")
    n, h, w, k, bf16 = 2048, 2048, 768, 8, torch.bfloat16
    estimate = lambda tp=1, ep=False: estimate_activation_bytes(cfg, bf16, n, 64, 16, tp, ep)
    fused_caches = n * k * (3 * w + h) * 2
    assert estimate() > n * kv_cache_bytes_per_token(cfg, bf16, 1) + fused_caches
    dense_mlp = n * (2 * h + 4 * cfg.intermediate_size) * 2
    assert dense_mlp < fused_caches                      # the check can fail: dense is narrower
    assert estimate(tp=2, ep=True) > estimate(tp=2) > estimate(tp=4)
