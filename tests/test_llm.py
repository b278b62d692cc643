"""LLM.generate against the oracle, HF transformers `generate`, token for token (greedy),
on tiny random Llama / Qwen2 / Qwen3 checkpoints, in every scheduling regime."""

import copy
import json
import random

import pytest
import torch

from nanoserve import LLM, SamplingParams
from nanoserve.cpu import kernels as cpu_kernels

GREEDY = dict(temperature=0.0, ignore_eos=True)


def hf_greedy(model, prompt, max_tokens):
    ids = model.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False,
                         pad_token_id=0, attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    return ids[0, len(prompt):].tolist()


def workload(seed=0, n=6, shared_prefix=0, vocab=384):
    rng = random.Random(seed)
    prefix = [rng.randrange(1, vocab) for _ in range(shared_prefix)]
    lengths = [1, 200] + [rng.randint(2, 120) for _ in range(n - 2)]
    return [(prefix + [rng.randrange(1, vocab) for _ in range(L)])[:200] for L in lengths], \
        [rng.randint(4, 24) for _ in lengths]


def check_against_hf(llm, model, prompts, max_tokens):
    params = [SamplingParams(max_tokens=m, **GREEDY) for m in max_tokens]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, progress=False)
    for p, m, out in zip(prompts, max_tokens, outs):
        assert out.prompt_token_ids == p
        assert out.outputs[0].token_ids == hf_greedy(model, p, m), f"prompt of {len(p)} tokens"
        assert out.outputs[0].finish_reason == "length"
    kv = llm.engine.kv_cache_manager.pool
    assert kv.num_free_blocks == kv.num_blocks          # nothing leaked


@pytest.mark.parametrize("setup", ["roomy", "preempt", "chunked"])
def test_greedy_equals_hf(checkpoint, setup):
    path, model = checkpoint
    kwargs = {"roomy": dict(num_kv_blocks=256),
              "preempt": dict(num_kv_blocks=16, max_num_seqs=8),
              "chunked": dict(num_kv_blocks=256, max_num_batched_tokens=48)}[setup]
    llm = LLM(path, block_size=16, max_model_len=256, **kwargs)
    prompts, max_tokens = workload(n=8)
    if setup == "preempt":   # 8 prompts of 3 blocks that grow to 4: 16 blocks cannot hold them
        prompts, max_tokens = [p[:40] + [7] * (40 - len(p)) for p in prompts], [24] * 8
    check_against_hf(llm, model, prompts, max_tokens)
    if setup == "preempt":
        assert llm.engine.scheduler.num_preemptions_total > 0


@pytest.mark.parametrize("caching", [True, False])
def test_greedy_equals_hf_with_shared_prefixes(checkpoint, caching):
    path, model = checkpoint
    llm = LLM(path, block_size=16, num_kv_blocks=128, enable_prefix_caching=caching)
    prompts, max_tokens = workload(seed=1, n=6, shared_prefix=64)
    check_against_hf(llm, model, prompts, max_tokens)
    # A second round hits the blocks the first round left cached.
    check_against_hf(llm, model, prompts[2:4], max_tokens[2:4])
    assert (llm.engine.kv_cache_manager.prefix_cache_hits > 0) == caching


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    from conftest import build_checkpoint
    path = tmp_path_factory.mktemp("llama_llm")
    model = build_checkpoint(path, "llama")
    return LLM(str(path), block_size=16, num_kv_blocks=128), model


def test_text_prompts_stop_strings_and_n(llama):
    llm, _ = llama
    prompt = "the quick brown fox"
    out = llm.generate(prompt, SamplingParams(max_tokens=30, **GREEDY), progress=False)[0]
    assert out.prompt == prompt and out.prompt_token_ids == llm.tokenizer.encode(prompt)
    text = out.outputs[0].text
    assert text == llm.tokenizer.decode(out.outputs[0].token_ids)
    # Stop on a piece of the greedy text: the output ends right before it.
    stop = next(text[i:i + 3] for i in range(5, len(text) - 3) if "\ufffd" not in text[i:i + 3])
    cut = llm.generate(prompt, SamplingParams(max_tokens=30, stop=[stop], **GREEDY),
                       progress=False)[0].outputs[0]
    assert cut.text == text[:text.index(stop)]
    assert (cut.finish_reason, cut.stop_reason) == ("stop", stop)
    kept = llm.generate(prompt, SamplingParams(max_tokens=30, stop=stop, include_stop_str_in_output=True,
                                               **GREEDY), progress=False)[0].outputs[0]
    assert kept.text == text[:text.index(stop) + len(stop)]
    # n > 1, seeded: children differ from each other, and the whole output reproduces.
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=12, ignore_eos=True)
    hits_before = llm.engine.kv_cache_manager.prefix_cache_hits
    first = llm.generate({"prompt_token_ids": list(range(1, 40))}, params, progress=False)[0]
    assert llm.engine.kv_cache_manager.prefix_cache_hits - hits_before >= 2 * 32   # shared prompt
    again = llm.generate({"prompt_token_ids": list(range(1, 40))}, params, progress=False)[0]
    assert [c.index for c in first.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in first.outputs}) == 3
    assert [c.token_ids for c in first.outputs] == [c.token_ids for c in again.outputs]


def test_logprobs_are_raw_log_softmax(llama):
    llm, model = llama
    prompt = list(range(5, 25))
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=3, logprobs=4, **GREEDY),
                       progress=False)[0].outputs[0]
    with torch.no_grad():
        logits = model(torch.tensor([prompt + out.token_ids])).logits[0, len(prompt) - 1:-1]
    ref = logits.log_softmax(-1)
    for step, (token, entry) in enumerate(zip(out.token_ids, out.logprobs)):
        assert entry[token].rank == 1 and len(entry) == 4
        top = ref[step].topk(4)
        assert list(entry) == top.indices.tolist()
        assert [e.logprob for e in entry.values()] == pytest.approx(top.values.tolist(), abs=1e-4)


def test_bad_input_is_refused_without_leaking(llama):
    llm, _ = llama
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate({"prompt_token_ids": [1] * 600}, progress=False)
    with pytest.raises(ValueError, match="prompt_token_ids"):
        llm.generate({"prompt_token_ids": [1, 10**6]}, progress=False)
    with pytest.raises(ValueError, match="sampling_params"):
        llm.generate(["a", "b"], [SamplingParams()], progress=False)
    with pytest.raises(ValueError, match="empty"):
        llm.generate("", progress=False)
    # The good prompt listed before a bad one was not left in the engine.
    with pytest.raises(ValueError):
        llm.generate(["fine", {"prompt_token_ids": []}], progress=False)
    assert not llm.engine.has_unfinished_requests()
    pool = llm.engine.kv_cache_manager.pool
    assert pool.num_free_blocks == pool.num_blocks


def test_loading_errors(tmp_path):
    from conftest import build_checkpoint
    with pytest.raises(ValueError, match="not a local directory"):
        LLM(str(tmp_path / "nowhere"))
    build_checkpoint(tmp_path / "m", "llama")
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (tmp_path / "m" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="GPT2LMHeadModel.*LlamaForCausalLM"):
        LLM(str(tmp_path / "m"))
    build_checkpoint(tmp_path / "w", "llama")
    (tmp_path / "w" / "model.safetensors").unlink()
    with pytest.raises(ValueError, match="no .*safetensors"):
        LLM(str(tmp_path / "w"))
    build_checkpoint(tmp_path / "ok", "llama")
    with pytest.raises(ValueError, match="less than one sequence of max_model_len"):
        LLM(str(tmp_path / "ok"), num_kv_blocks=2)



def check_bf16_against_hf(llm, model, prompts, max_tokens):
    """bf16 greedy == HF's bf16 greedy, except where HF itself nearly ties: two bf16 programs
    that sum in different orders may round a logit differently. From the first token where the
    two differ, HF's margin for its own choice over ours must be within bf16's rounding of the
    logits (2^-7 of their largest magnitude); up to it the tokens must be identical."""
    params = [SamplingParams(max_tokens=m, **GREEDY) for m in max_tokens]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, progress=False)
    for p, m, out in zip(prompts, max_tokens, outs):
        ours, theirs = out.outputs[0].token_ids, hf_greedy(model, p, m)
        if ours == theirs:
            continue
        first = next(i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b)
        with torch.no_grad():
            logits = model(torch.tensor([p + theirs[:first]])).logits[0, -1].float()
        margin = logits[theirs[first]] - logits[ours[first]]
        assert margin <= logits.abs().max() * 2**-7, f"prompt of {len(p)} tokens, token {first}"


def check_dtype_against_hf(llm, model, dtype: str, seed: int) -> None:
    prompts, max_tokens = workload(seed=seed, n=4)
    if dtype == "float32":
        check_against_hf(llm, model, prompts, max_tokens)
    else:
        check_bf16_against_hf(llm, copy.deepcopy(model).to(torch.bfloat16), prompts, max_tokens)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("backend", ["torch", "cpu", "cpu-eager"])
def test_greedy_equals_hf_on_the_torch_reference_and_the_cpu_backend(checkpoint, dtype, backend,
                                                                     monkeypatch):
    """Both paths to HF's tokens: the model on the torch reference alone
    (NANOSERVE_CPU_KERNEL=0, the code the lessons teach) and on the CPU backend, its decode steps
    captured and replayed (cpu/graphs.py) and with --enforce-eager; float32, and bfloat16 against
    HF in bf16."""
    if backend != "torch" and cpu_kernels.load() is None:
        pytest.skip("no C compiler here")
    monkeypatch.setenv("NANOSERVE_CPU_KERNEL", "0" if backend == "torch" else "1")
    ckpt, model = checkpoint
    llm = LLM(ckpt, block_size=16, num_kv_blocks=128, max_model_len=256, dtype=dtype,
              enforce_eager=backend == "cpu-eager")
    backend_name = llm.engine.executor.model_runner.backend.name
    assert backend_name == ("torch" if backend == "torch" else "cpu")
    check_dtype_against_hf(llm, model, dtype, seed=3)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("path", ["torch", "onednn", "onednn-fp32", "kernel"])
def test_greedy_equals_hf_on_every_cpu_gemm_path(checkpoint, dtype, path):
    """Every CPU product path (cpu/gemm.py), forced, gives HF's greedy tokens, in float32 and in
    bfloat16 (HF run in bf16 too). A path this CPU's oneDNN cannot run falls back to torch."""
    ckpt, model = checkpoint
    if path == "onednn-fp32" and dtype == "float32":
        pytest.skip("onednn-fp32 is the bf16 model's float32 path; for float32 it is 'onednn'")
    if path == "kernel" and cpu_kernels.load() is None:
        pytest.skip("no C compiler here")
    llm = LLM(ckpt, block_size=16, num_kv_blocks=128, max_model_len=256, dtype=dtype, cpu_gemm=path)
    chosen = set(llm.engine.executor.gemm_paths.values())
    assert chosen <= {path, "torch"} and (path in chosen or dtype == "bfloat16")
    check_dtype_against_hf(llm, model, dtype, seed=2)


def test_checkpoint_without_tokenizer_runs_token_ids_with_skip_tokenizer_init(checkpoint, tmp_path):
    """vLLM's skip_tokenizer_init: weights without tokenizer files serve token-id prompts."""
    import shutil
    from pathlib import Path
    src, model = checkpoint
    for f in Path(src).iterdir():
        if not f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(f, tmp_path / f.name)
    with pytest.raises(ValueError, match="skip_tokenizer_init"):
        LLM(str(tmp_path), num_kv_blocks=64)
    llm = LLM(str(tmp_path), num_kv_blocks=64, skip_tokenizer_init=True)
    assert llm.tokenizer is None
    prompt = [5, 17, 99, 3]
    (out,) = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=8, **GREEDY),
                          progress=False)
    assert out.outputs[0].token_ids == hf_greedy(model, prompt, 8) and out.outputs[0].text == ""
    with pytest.raises(ValueError, match="prompt_token_ids"):
        llm.generate("a text prompt", progress=False)
    with pytest.raises(ValueError, match="stop strings"):
        llm.generate([{"prompt_token_ids": prompt}], SamplingParams(stop=["x"]), progress=False)
    assert llm.engine.kv_cache_manager.pool.num_free_blocks == llm.engine.kv_cache_manager.pool.num_blocks
