"""gpu_smoke.py: what only a GPU can show about nanoserve's CUDA path, in one command (a few minutes
on an H200, at most 10), printed for a person to read.

    python scripts/gpu_smoke.py        # from the repository root, on a machine with a CUDA GPU
    python scripts/gpu_smoke.py fp8-products speculation      # only the sections named

Sections, in order; each runs even when one before it failed (a failure prints its traceback):

  warm-up          compile_kernels' time, and no compile left for serving steps after it
  kernels          compiled store_kv + attention == the torch reference at real head shapes, fp32, bf16
  triton ops       norm, RoPE + store, silu·mul, fp8 activations, split-K decode == their references
  fused moe        the Triton fused MoE == FusedMoE's reference at Qwen3-30B-A3B's layer, its time (gpu_moe.py)
  LLM float32      LLM(device='cuda') start-up time and KV pool; its greedy == CPU greedy, token for token
  LLM bfloat16     bf16 greedy vs float32 greedy: the fraction of tokens that agree
  fp8 products     torch._scaled_mm == dequantize-then-F.linear, 1-300 rows; its time against bf16's
  quantized model  int8 / fp8 perplexity within 3% / 5% of bf16's; the greedy story they share
  speculation      n-gram drafts: greedy == greedy without them, alone and batched; acceptance
  seeded sampling  a seeded request alone == the same request inside a batch of 8
  throughput       bench's workload (tools/bench.py), batch-1 decode; bf16, fp8, int8: tok/s, step split
  graphs           CUDA graphs (gpu_graphs.py): replay == eager, greedy == --enforce-eager, launches a step
  graph speed      eager vs graphs: bf16/fp8/int8 at batch 1, 8, 64; HF generate; Llama-3-8B shape vs its bound
  serve            `nanoserve serve --device cuda` answers one /v1/completions on loopback
  kernel tests     tests/test_paged_attention_triton.py with the kernels compiled (TRITON_INTERPRET=0)
  past 2^31        a bf16 step with blocks past 2^31 cache elements (last: a fault there breaks the context)

Then a summary table. Each section has a time limit (a hang is a FAIL), and sections left when 9 1/3
minutes are spent are skipped. Exit status: 0 all passed, 1 a section failed or was skipped, 2 no CUDA
device here.
"""

import functools
import itertools
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from types import SimpleNamespace

os.environ["TRITON_INTERPRET"] = "0"  # compiled kernels, whatever the caller's environment says
import torch  # noqa: E402
from gpu_graphs import free_cuda_memory, gpu_us, graph_speed, graphs  # noqa: E402  (scripts/ is on sys.path)
from gpu_moe import fused_moe  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = ["Once upon a time", "The little dog", "A bird sang", "Tell me a story about a cat."]
TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}
KERNEL_TESTS_LIMIT_S, SERVE_LIMIT_S = 240, 120  # and the other sections' limits in main(): a hang is a FAIL
TOTAL_LIMIT_S = 560  # the whole command within 10 minutes, start-up and summary included


# ---------------------------------------------------------------------------------------- kernels


def random_step(query_lens, seq_lens, num_heads, num_kv_heads, head_dim, dtype, first_block=0, seed=0):
    """A step over a paged cache whose requests own shuffled blocks from first_block on (the blocks
    below stay unwritten): the earlier tokens' K/V are random, this step's new ones stored with
    store_kv_triton, and checked to sit at their slots. Returns (query, k_cache, v_cache, metadata)."""
    from nanoserve.cuda.paged_attention_triton import store_kv_triton
    dev, bs = torch.device("cuda"), 16
    g = torch.Generator(device=dev).manual_seed(seed)
    randn = functools.partial(torch.randn, generator=g, device=dev)
    blocks = [-(-s // bs) for s in seq_lens]
    ids = first_block + torch.randperm(sum(blocks), generator=g, device=dev)
    k_cache = torch.empty(first_block + sum(blocks), bs, num_kv_heads, head_dim, dtype=dtype, device=dev)
    v_cache = torch.empty_like(k_cache)
    k_cache[ids], v_cache[ids] = (randn(len(ids), bs, num_kv_heads, head_dim).to(dtype) for _ in range(2))
    tables = torch.zeros(len(blocks), max(blocks), dtype=torch.int32, device=dev)
    for i, row in enumerate(ids.split(blocks)):
        tables[i, :len(row)] = row.int()
    slots = torch.cat([tables[i, p // bs].long() * bs + p % bs for i, p in enumerate(
        torch.arange(s - q, s, device=dev) for q, s in zip(query_lens, seq_lens))])
    new_k, new_v = (randn(len(slots), num_kv_heads, head_dim).to(dtype) for _ in range(2))
    store_kv_triton(new_k, new_v, k_cache, v_cache, slots)
    rows = (-1, num_kv_heads, head_dim)
    assert torch.equal(k_cache.view(rows)[slots], new_k) and torch.equal(v_cache.view(rows)[slots], new_v)
    qsl = torch.tensor([0] + query_lens, device=dev).cumsum(0).int()
    md = SimpleNamespace(slot_mapping=slots, block_tables=tables, query_start_loc=qsl,
                         seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
                         max_query_len=max(query_lens), num_reqs=len(seq_lens))
    return randn(len(slots), num_heads, head_dim).to(dtype), k_cache, v_cache, md


def attention_error(step, scale) -> float:
    """Max |Triton - torch reference| over the step's outputs."""
    from nanoserve.cuda.paged_attention_triton import paged_attention_triton
    from nanoserve.paged_attention import paged_attention_torch
    out = paged_attention_triton(*step, scale)
    return (out.float() - paged_attention_torch(*step, scale).float()).abs().max().item()


def kernel_tests() -> str:
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          "tests/test_paged_attention_triton.py"], cwd=ROOT, capture_output=True,
                         text=True, timeout=KERNEL_TESTS_LIMIT_S - 10)
    print(run.stdout[-4000:], run.stderr[-2000:])
    assert run.returncode == 0, f"pytest exit code {run.returncode}"
    return run.stdout.strip().splitlines()[-1]


def compiled_kernels() -> int:
    """Kernels Triton compiled so far in this process (its per-device cache)."""
    from nanoserve.cuda import decode_attention_triton as dat
    from nanoserve.cuda import norm_rope_triton as nr
    from nanoserve.cuda import paged_attention_triton as pat
    return sum(len(k.device_caches[torch.cuda.current_device()][0])
               for k in (nr._rope_store_kv_kernel, pat._unified_attention_kernel,
                         dat._split_kv_decode_kernel, dat._reduce_segments_kernel))


def warm_up() -> str:
    from nanoserve.cuda.backend import attention, compile_kernels
    start = time.perf_counter()
    compile_kernels(28, 4, 128, 16, torch.bfloat16, torch.device("cuda"))  # Qwen2.5-7B's heads
    took, compiled = time.perf_counter() - start, compiled_kernels()
    # Decodes (split-K, then 40 x 4 kv heads: unified), then mixed steps, with block tables 1, 16
    # and neither wide (the longest table's blocks).
    for query_lens, seq_lens in (([1], [3]), ([1] * 3, [16 * 16] * 3), ([1, 1], [20, 700]),
                                 ([1] * 40, [20] * 40), ([3], [3]), ([5, 1], [256, 9]),
                                 ([64, 1, 1], [64, 17, 513])):
        query, *caches, md = random_step(query_lens, seq_lens, 28, 4, 128, torch.bfloat16)
        attention(SimpleNamespace(scale=128**-0.5), query, caches, md)
    print(f"compile_kernels: {took:.1f} s, {compiled} kernels; after 7 varied steps: {compiled_kernels()}")
    assert compiled_kernels() == compiled, "a serving step compiled a kernel that the warm-up did not"
    return f"{took:.1f} s, {compiled} kernels"


def kernels() -> str:
    worst = {}
    for dtype in (torch.float32, torch.bfloat16):
        for head_dim in (64, 80, 96, 128):
            for group in (1, 4, 8):
                step = random_step([1, 1, 9, 40], [1, 300, 70, 40], 4 * group, 4, head_dim, dtype)
                err = attention_error(step, head_dim**-0.5)
                print(f"{str(dtype):15} head_dim {head_dim:3} group {group}: max error {err:.2e}")
                assert err <= TOL[dtype], f"{dtype} head_dim {head_dim} group {group}: error {err}"
                worst[dtype] = max(worst.get(dtype, 0.0), err)
    return ", ".join(f"{str(k).removeprefix('torch.')} max err {v:.1e}" for k, v in worst.items())


def triton_ops() -> str:
    """Each Triton op of the CUDA backend == its forward_native (layers.py) at SmolLM2-135M's and
    Llama-3-8B's shapes, float32 and bf16, 1 and 300 tokens; split-K decode == the unified kernel
    at batch 1..8; fp8 activations == the torch quantization (quantized.py), value for value."""
    from nanoserve.cuda import activation_triton as act
    from nanoserve.cuda import norm_rope_triton as nr
    from nanoserve.cuda.decode_attention_triton import split_kv_decode_attention
    from nanoserve.cuda.paged_attention_triton import paged_attention_triton
    from nanoserve.cuda.quantized import per_token_quant_fp8_torch
    from nanoserve.layers import RMSNorm, RopeStoreKV, SiluAndMul
    g, worst = torch.Generator(device="cuda").manual_seed(4), {}
    randn = functools.partial(torch.randn, generator=g, device="cuda")
    for (hidden, inter, hq, hkv, d), dtype, n in itertools.product(
            ((576, 1536, 9, 3, 64), (4096, 14336, 32, 8, 128)), (torch.float32, torch.bfloat16), (1, 300)):
        norm = RMSNorm(hidden, 1e-5).cuda().to(dtype)
        norm.weight.data = randn(hidden).to(dtype)
        x, res = randn(n, hidden).to(dtype), randn(n, hidden).to(dtype)
        qkv, angles = randn(n, hq + 2 * hkv, d).to(dtype), randn(n, 1, d // 2)
        q, k, v = qkv.split([hq, hkv, hkv], dim=1)
        rope, slots = (angles.cos().to(dtype), angles.sin().to(dtype)), torch.randperm(n * 2, device="cuda")[:n]
        ours, ref = (torch.zeros(2, n * 2 // 16 + 1, 16, hkv, d, dtype=dtype, device="cuda") for _ in range(2))
        pairs = {"rms_norm": (nr.rms_norm_triton(norm.weight, 1e-5, x, res.clone())[0], norm.forward_native(x, res.clone())[0]),
                 "rope_store_kv": (nr.rope_store_kv_triton(*rope, q, k, v, *ours, slots),
                                   RopeStoreKV().forward_native(rope, q, k, v, tuple(ref), slots)),
                 "kv cache": (ours, ref),
                 "silu_and_mul": (act.silu_and_mul_triton(gate_up := randn(n, 2 * inter).to(dtype)),
                                  SiluAndMul().forward_native(gate_up))}
        for name, (a, b) in pairs.items():
            err = ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()
            worst[name] = max(worst.get(name, 0.0), err)
            assert err <= TOL[dtype], f"{name} {dtype} hidden {hidden}, {n} tokens: error {err}"
        rows = randn(n, inter).bfloat16()
        assert all(map(torch.equal, act.per_token_quant_fp8_triton(rows), per_token_quant_fp8_torch(rows))), "fp8"
    for batch in (1, 2, 8):
        step = random_step([1] * batch, [1 + 97 * i for i in range(batch)], 32, 8, 128, torch.bfloat16)
        err = (split_kv_decode_attention(*step, 128**-0.5).float() - paged_attention_triton(*step, 128**-0.5).float()).abs().max().item()
        worst["split-K"] = max(worst.get("split-K", 0.0), err)
        assert err <= TOL[torch.bfloat16], f"split-K batch {batch}: error {err}"
    print("\n".join(f"{name:14} max error / max |ref| {err:.1e}" for name, err in worst.items()))
    return ", ".join(f"{name} {err:.0e}" for name, err in worst.items()) + "; fp8 equal"


def past_int32() -> str:
    stride = 16 * 8 * 128  # block_size x kv heads x head_dim: elements per block
    first = 2**31 // stride  # every block of the step starts at element >= 2^31
    step = random_step([7, 1], [50, 300], 32, 8, 128, torch.bfloat16, first_block=first)
    err = attention_error(step, 128**-0.5)
    top = step[1].numel()
    print(f"cache of {top} elements ({top / 2**31:.3f} x 2^31) per K and V; max error {err:.2e}")
    assert err <= TOL[torch.bfloat16], f"error {err}"
    return f"max err {err:.1e}"


# -------------------------------------------------------------------------------------------- LLM


@functools.cache
def greedy(device: str, dtype: str) -> tuple:
    from nanoserve import LLM, SamplingParams
    start = time.perf_counter()
    # The first CUDA engine sizes its KV pool as serving would (profiled); the others take 4 GiB.
    first_cuda = (device, dtype) == ("cuda", "float32")
    llm = LLM(device=device, dtype=dtype, **({} if first_cuda or device == "cpu" else {"kv_cache_memory_gb": 4}))
    startup, config = time.perf_counter() - start, llm.config
    print(f"LLM(device={device!r}, dtype={dtype!r}): start-up {startup:.1f} s, KV pool "
          f"{config.num_kv_blocks} blocks x {config.block_size} = {config.num_kv_blocks * config.block_size} tokens")
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    tokens = tuple(o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, progress=False))
    del llm
    free_cuda_memory()
    return tokens


def llm_float32() -> str:
    cuda, cpu = greedy("cuda", "float32"), greedy("cpu", "float32")
    for prompt, a, b in zip(PROMPTS, cuda, cpu):
        first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
        print(f"{prompt!r}: {'equal' if first is None else f'differ from token {first}'}")
    assert cuda == cpu, "CUDA float32 greedy != CPU float32 greedy"
    return "CUDA == CPU greedy"


def llm_bfloat16() -> str:
    bf16, fp32 = greedy("cuda", "bfloat16"), greedy("cuda", "float32")
    same = sum(x == y for a, b in zip(bf16, fp32) for x, y in zip(a, b))
    total = sum(map(len, fp32))
    print(f"bf16 tokens equal to float32's, position by position: {same}/{total}")
    assert same >= total / 2, "bf16 agrees with float32 on fewer than half the tokens"
    return f"{same / total:.0%} of tokens agree"


def seeded_sampling() -> str:
    from nanoserve import LLM, SamplingParams
    llm = LLM(device="cuda", dtype="float32", kv_cache_memory_gb=4)  # float32: no bf16 batch noise
    params = [SamplingParams(temperature=1.0, seed=1000 + i, max_tokens=32, ignore_eos=True) for i in range(8)]
    alone = llm.generate([PROMPTS[3]], params[3], progress=False)[0].outputs[0].token_ids
    batch = llm.generate([PROMPTS[i % 4] for i in range(8)], params, progress=False)
    del llm
    free_cuda_memory()
    print(f"alone: {alone}\nbatch: {batch[3].outputs[0].token_ids}")
    assert batch[3].outputs[0].token_ids == alone, "the seeded request changed inside a batch"
    return "alone == in a batch of 8"


def throughput() -> str:
    """nanoserve bench's workload (tools/bench.py) and decode at batch 1, SmolLM2-135M-shaped, in
    bf16, fp8 (scaled_mm) and int8 (widened to bf16 in the product: no int8 kernel on CUDA)."""
    from nanoserve.tools.bench import make_bench_llm, make_workload, time_workload
    prompts, output_lens = make_workload(64)
    rates = {}
    for q in (None, "fp8", "int8"):
        llm = make_bench_llm(dtype="bfloat16", device="cuda", quantization=q)
        one, result = time_workload(llm, [prompts[0][:16]], [128]), time_workload(llm, prompts, output_lens)
        del llm
        free_cuda_memory()
        rates[q] = one["output_tok_s"], result["output_tok_s"]
        split = ", ".join(f"{k} {v:.2f}" for k, v in result["ms_per_step"].items())
        print(f"{q or 'bfloat16'}: batch 1 {rates[q][0]:.1f} tok/s ({rates[q][0] / rates[None][0]:.2f}x); "
              f"64 requests {rates[q][1]:.0f} tok/s ({rates[q][1] / rates[None][1]:.2f}x), {result['steps']} "
              f"steps, mean batch {result['mean_batch_size']:.1f}; ms/step: {split}")
    return f"bf16 {rates[None][1]:.0f} tok/s; fp8 {rates['fp8'][1] / rates[None][1]:.2f}x, int8 {rates['int8'][1] / rates[None][1]:.2f}x"


def serve() -> str:
    import httpx
    sys.path.insert(0, str(ROOT / "scripts"))
    from compare_serving import running  # starts, waits for /health, always stops
    from nanoserve.distributed import free_port
    port = free_port()
    cmd = [sys.executable, "-m", "nanoserve.cli", "serve", "--device", "cuda", "--host", "127.0.0.1",
           "--port", str(port), "--kv-cache-memory-gb", "4"]
    with tempfile.TemporaryDirectory() as logs, running("nanoserve", cmd, dict(os.environ), port, logs,
                                                        timeout=SERVE_LIMIT_S - 30) as (url, _):
        body = {"model": "nanoserve-tiny", "prompt": PROMPTS[0], "max_tokens": 16, "temperature": 0}
        answer = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        answer.raise_for_status()
        text = answer.json()["choices"][0]["text"]
    print(f"/v1/completions: {text!r}")
    return f"answered {len(text)} chars"


# ------------------------------------------------------------------- quantization and speculation


def fp8_products() -> str:
    """torch._scaled_mm (per-token activation scales) == dequantize-then-F.linear (the Linear's
    torch reference) at SmolLM2-135M's and Llama-3-8B's product shapes, 1, 7, 64 and 300 rows; its
    time (wall and GPU) against the bf16 product it replaces, and _scaled_mm's kernel alone."""
    from nanoserve.cuda.quantized import scaled_mm_linear, uses_scaled_mm
    from nanoserve.layers import Linear
    from nanoserve.quantization import quantize
    g, capability, worst = torch.Generator(device="cuda").manual_seed(3), torch.cuda.get_device_capability(), 0.0
    for in_f, out_f in ((576, 3072), (1536, 576), (4096, 6144), (14336, 4096)):
        w = torch.randn(out_f, in_f, generator=g, device="cuda") * in_f**-0.5
        linear = Linear(in_f, out_f, bias=False, quantization="fp8").cuda()
        assert uses_scaled_mm(linear, capability, torch.bfloat16), f"capability {capability}: no scaled_mm"
        linear.weight.data, linear.weight_scale = quantize(w, "fp8")
        bf16 = w.bfloat16()
        for m in (1, 7, 64, 300):
            x = torch.randn(m, in_f, generator=g, device="cuda").bfloat16()
            y, ref = scaled_mm_linear(linear, x).float(), linear.forward_native(x).float()
            err = ((y - ref).abs().max() / ref.abs().max()).item()
            worst = max(worst, err)
            torch.testing.assert_close(y, ref, atol=0.1 * ref.abs().max().item(), rtol=0.1)
            xq, ones = x.to(torch.float8_e4m3fn), torch.ones(m, 1, device="cuda")   # timing only
            (bw, bg), (fw, fg), (_, kg) = (gpu_us(f) for f in (
                lambda: torch.nn.functional.linear(x, bf16), lambda: scaled_mm_linear(linear, x), lambda: torch._scaled_mm(
                    xq, linear.weight.t(), scale_a=ones, scale_b=linear.weight_scale[None, :], out_dtype=torch.bfloat16)))
            print(f"{in_f:5} -> {out_f:5}, {m:3} rows: error / max |y| {err:.1e}; µs wall bf16 {bw:5.1f} fp8 "
                  f"{fw:5.1f}, GPU bf16 {bg:5.1f} fp8 {fg:5.1f} (_scaled_mm's kernel {kg:5.1f})")
    return f"max err {worst:.1e} of max |y|"


def quantized_model() -> str:
    """The built-in model in bf16, int8 and fp8 on CUDA: fp8's products on scaled_mm, held-out
    perplexity within 3% (int8) / 5% (fp8) of bf16, and the greedy story's first 32 tokens."""
    sys.path.insert(0, str(ROOT / "tests"))
    from nanoserve import LLM, SamplingParams
    from test_quantization import held_out_docs, perplexity   # the CPU test's oracle, here on CUDA
    ppl, story, docs = {}, {}, None
    for q in (None, "int8", "fp8"):
        llm = LLM("nanoserve-tiny", device="cuda", dtype="bfloat16", quantization=q, kv_cache_memory_gb=1)
        docs = docs or [llm.tokenizer(d, add_special_tokens=False).input_ids for d in held_out_docs()]
        paths = llm.engine.executor.gemm_paths
        ppl[q] = perplexity(llm.engine.executor.model_runner, docs)
        story[q] = llm.generate([PROMPTS[0]], SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True),
                                progress=False)[0].outputs[0].token_ids
        print(f"{q or 'bfloat16'}: perplexity {ppl[q]:.5f}; product paths {paths}")
        del llm
        free_cuda_memory()
        assert q != "fp8" or "scaled_mm" in paths.values(), "no fp8 product runs on scaled_mm"
    same = {q: next((i for i, (a, b) in enumerate(zip(story[q], story[None])) if a != b), 32) for q in story}
    print(f"greedy story: the first {same['int8']} (int8) and {same['fp8']} (fp8) of 32 tokens equal bf16's")
    assert ppl["int8"] <= 1.03 * ppl[None] and ppl["fp8"] <= 1.05 * ppl[None], ppl
    return f"ppl bf16 {ppl[None]:.3f} int8 {ppl['int8']:.3f} fp8 {ppl['fp8']:.3f}; story {same['fp8']}/32"


def speculation() -> str:
    """n-gram speculation on CUDA, float32: greedy == greedy without it, alone and batched, on
    bench_spec_decode.py's copy-heavy prompts (the KV invariants checked every step, debug=2);
    acceptance, and tok/s at batch 1 against speculation off."""
    from bench_spec_decode import copy_heavy_workload   # this script's folder is on sys.path
    from nanoserve import LLM, SamplingParams
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5}
    common = dict(device="cuda", dtype="float32", kv_cache_memory_gb=2, max_model_len=512)
    plain, checked = LLM("nanoserve-tiny", **common), LLM("nanoserve-tiny", **common, debug=2, speculative_config=spec)
    fast = LLM("nanoserve-tiny", **common, speculative_config=spec)
    token_ids, _, _ = copy_heavy_workload(plain, num_prompts=4, min_story_len=48, story_len=100)
    prompts = [{"prompt_token_ids": p} for p in token_ids]
    params = SamplingParams(temperature=0.0, max_tokens=64)
    ids = lambda llm, ps: [o.outputs[0].token_ids for o in llm.generate(ps, params, progress=False)]
    want, batched = ids(plain, prompts), ids(checked, prompts)
    alone = [ids(checked, [p])[0] for p in prompts]
    for i, (w, b, a) in enumerate(zip(want, batched, alone)):
        print(f"prompt {i}: batched {'equal' if b == w else 'DIFFERS'}, alone {'equal' if a == w else 'DIFFERS'}")
    stats = checked.engine.get_stats()
    acceptance = stats["spec_decode_num_accepted_tokens_total"] / max(stats["spec_decode_num_draft_tokens_total"], 1)
    rate = {}
    for name, llm in (("off", plain), ("K=4", fast)):
        ids(llm, prompts[:1])                   # warm
        start = time.perf_counter()
        rate[name] = sum(len(ids(llm, [p])[0]) for p in prompts) / (time.perf_counter() - start)
    print(f"acceptance {acceptance:.2f}; batch 1: off {rate['off']:.0f} tok/s, K=4 {rate['K=4']:.0f} tok/s")
    del plain, checked, fast
    free_cuda_memory()
    assert batched == want and alone == want, "greedy with speculation != greedy without it"
    return f"== greedy; acceptance {acceptance:.2f}; batch 1 {rate['K=4'] / rate['off']:.2f}x"


# ------------------------------------------------------------------------------------------- main


def _timeout(signum, frame):
    raise TimeoutError("the section ran past its time limit")


def run(sections) -> list[tuple[str, str, float, str]]:
    """Each (name, function, limit in s): its result note, or FAIL with the traceback printed;
    SKIP once the whole run's TOTAL_LIMIT_S is spent."""
    results, begin = [], time.perf_counter()
    signal.signal(signal.SIGALRM, _timeout)
    for name, fn, limit in sections:
        left = int(TOTAL_LIMIT_S - (time.perf_counter() - begin))
        if left <= 0:
            results.append((name, "SKIP", 0.0, "out of time"))
            continue
        print(f"\n=== {name} ===", flush=True)
        start, status = time.perf_counter(), "ok"
        signal.alarm(min(limit, left))
        try:
            note = fn()
        except (Exception, SystemExit) as e:  # compare_serving.running exits when the server dies
            traceback.print_exc()
            status, note = "FAIL", f"{type(e).__name__}: {e}".splitlines()[0][:70]
        finally:
            signal.alarm(0)
        results.append((name, status, time.perf_counter() - start, note))
    return results


def main() -> int:
    if not torch.cuda.is_available():
        build = "a CPU build" if torch.version.cuda is None else f"built for CUDA {torch.version.cuda}"
        print(f"gpu_smoke: no CUDA device available (torch {torch.__version__} is {build}, "
              "torch.cuda.is_available() is False): nothing to check here")
        return 2
    import triton
    props = torch.cuda.get_device_properties(0)
    print(f"{props.name}, compute capability {props.major}.{props.minor}, {props.total_memory / 2**30:.0f} GiB; "
          f"torch {torch.__version__}, triton {triton.__version__}")
    sections = [("warm-up", warm_up, 60), ("kernels", kernels, 120), ("triton ops", triton_ops, 60),
                ("fused moe", fused_moe, 90),
                ("LLM float32", llm_float32, 150),
                ("LLM bfloat16", llm_bfloat16, 60), ("fp8 products", fp8_products, 60),
                ("quantized model", quantized_model, 90), ("speculation", speculation, 90),
                ("seeded sampling", seeded_sampling, 60), ("throughput", throughput, 150),
                ("graphs", functools.partial(graphs, PROMPTS), 90), ("graph speed", graph_speed, 220),
                ("serve", serve, SERVE_LIMIT_S), ("kernel tests", kernel_tests, KERNEL_TESTS_LIMIT_S),
                ("past 2^31", past_int32, 60)]
    by_name, chosen = {name.lower().replace(" ", "-"): (name, fn, t) for name, fn, t in sections}, set(sys.argv[1:])
    if chosen - by_name.keys():     # in their own order whatever the command's: past 2^31 stays last
        raise SystemExit(f"gpu_smoke: no section {sorted(chosen - by_name.keys())}; sections: {', '.join(by_name)}")
    results = run([s for key, s in by_name.items() if not chosen or key in chosen])
    print("\n" + "\n".join(f"{name:16} {status:5} {secs:6.1f} s  {note}" for name, status, secs, note in results))
    return int(any(status != "ok" for _, status, _, _ in results))


if __name__ == "__main__":
    sys.exit(main())
