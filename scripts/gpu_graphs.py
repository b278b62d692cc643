"""gpu_graphs.py: scripts/gpu_smoke.py's two sections on CUDA graphs (nanoserve/graph_capture.py,
nanoserve/cuda/graphs.py), and the helpers both files use (freeing an LLM's memory, timing a
call), kept here so that gpu_smoke.py stays under 400 lines. Run the sections through it:

    python scripts/gpu_smoke.py graphs graph-speed     # from the repository root, on a CUDA GPU

  graphs       a replay == the eager forward at the same padded size, bit for bit, float32 and
               bf16; float32 greedy with graphs == with --enforce-eager on the smoke prompts
               (batches shrinking from 8, so steps pad to 8, 4, 2); kernel launches a decode step,
               eager and replayed, counted by torch.profiler on the built-in model
  graph speed  eager against graphs in bf16, fp8 and int8 at batch 1, batch 8 and bench's
               64-request workload (tools/bench.py, SmolLM2-135M-shaped); HF transformers
               `generate` at batch 1 on the same GPU and checkpoint; a Llama-3-8B-shaped model
               (random weights built on the GPU, 2 and 4 layers) timed at batch 1, scaled to 32
               layers, against its bytes bound at the H200's ~4.8 TB/s

Each returns its one-line note for gpu_smoke's summary and raises where a check fails.
"""

import time
from collections import Counter

import torch

from nanoserve import LLM, SamplingParams
from nanoserve.cuda.graphs import CUDAGraph
from nanoserve.graph_capture import GraphWrapper
from nanoserve.step_inputs import padded_batch_size

HBM_BYTES_S = 4.8e12   # the H200's memory bandwidth
LLAMA3_8B = dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                 num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192,
                 rope_theta=500000.0, rms_norm_eps=1e-5, architectures=["LlamaForCausalLM"])


def free_cuda_memory() -> None:
    """Hand a deleted LLM's weights and KV pool back, before the next one profiles the free memory."""
    import gc
    gc.collect()
    torch.cuda.empty_cache()


def gpu_us(fn, calls: int = 50) -> tuple[float, float]:
    """(wall, GPU) µs a call of fn(), after 5 warm-up calls: wall, the calls back to back (above GPU where
    launching kernels takes longer than running them); GPU, the kernels' own times (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    wall = (time.perf_counter() - start) / calls * 1e6
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    return wall, sum(e.self_device_time_total for e in prof.key_averages() if e.device_type.name == "CUDA") / calls


def decode_step(runner, n: int, size: int, width: int = 8):
    """n <= 13 decodes (lengths 17, 26, ... 125) in blocks 0, 1, ..., `width` blocks each, placed
    in the runner's persistent inputs padded to `size`: (input_ids, positions, AttentionMetadata)."""
    bs, seq_lens = runner.block_size, torch.tensor([17 + 9 * i for i in range(n)])
    tables = torch.arange(n * width, dtype=torch.int32).view(n, width)
    pos = seq_lens - 1
    slots = tables[torch.arange(n), pos // bs].long() * bs + pos % bs
    ids, positions, meta, _ = runner.inputs.place(torch.arange(n) + 5, pos, slots, seq_lens,
                                                  torch.arange(n + 1), tables, torch.arange(n), 1,
                                                  num_rows=size)
    return ids, positions, meta


@torch.inference_mode()   # the eager forward as the runner calls it: no autograd
def replay_equals_eager(dtype: str, prompts: list[str]) -> str:
    """The built-in model's graphs against its eager forward at the same padded size."""
    llm = LLM(device="cuda", dtype=dtype, kv_cache_memory_gb=1)
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True), progress=False)
    runner, checked = llm.engine.executor.model_runner, []
    graphs = runner.backend.forward
    assert isinstance(graphs, GraphWrapper), f"no graphs captured: {graphs!r}"
    for n in (1, 3, 8, 13):
        size = padded_batch_size(n, runner.backend.cudagraph_capture_sizes)
        ids, positions, meta = decode_step(runner, n, size)
        graph, captured_ids = graphs.graphs[size]
        assert ids.data_ptr() == captured_ids.data_ptr(), "the step is not in the captured inputs"
        replayed = graph.replay()[:n].clone()
        eager = graphs.forward(ids, positions, runner.kv_caches, meta)[:n]
        err = (replayed.float() - eager.float()).abs().max().item()
        print(f"{dtype}: {n} decodes padded to {size}: replay - eager max |diff| {err:.1e}")
        assert torch.equal(replayed, eager), f"{dtype}, {n} padded to {size}: replay != eager"
        checked.append(f"{n}->{size}")
    del llm, graphs
    free_cuda_memory()
    return ", ".join(checked)


def greedy_with_and_without_graphs(prompts: list[str]) -> dict:
    """float32 greedy on 8 requests of 8-32 tokens (batches 8, 6, 4, 2: padded to 8, 8, 4, 2),
    with graphs and with enforce_eager; returns {size: replays}."""
    replays, real_replay = Counter(), CUDAGraph.replay
    CUDAGraph.replay = lambda graph: replays.update([graph.output.shape[0]]) or real_replay(graph)
    tokens = {}
    try:
        for eager in (False, True):
            llm = LLM(device="cuda", dtype="float32", kv_cache_memory_gb=2, enforce_eager=eager)
            params = [SamplingParams(temperature=0.0, max_tokens=8 * (1 + i % 4), ignore_eos=True) for i in range(8)]
            outs = llm.generate(prompts * 2, params, progress=False)
            tokens[eager] = [o.outputs[0].token_ids for o in outs]
            del llm
            free_cuda_memory()
    finally:
        CUDAGraph.replay = real_replay
    for i, (a, b) in enumerate(zip(tokens[False], tokens[True])):
        print(f"request {i}: graphs {'==' if a == b else '!='} enforce_eager ({len(a)} tokens)")
    print(f"replays by padded size: {dict(sorted(replays.items()))}")
    assert tokens[False] == tokens[True], "greedy with graphs != greedy with enforce_eager"
    assert replays, "no decode step replayed a graph"
    return replays


def launches(fn, calls: int = 5) -> tuple[float, float, float]:
    """(kernel launches, graph launches, GPU kernels) per call of fn, from torch.profiler: the host's
    launch calls (cudaLaunchKernel, Triton's cuLaunchKernel*) and the kernels the GPU ran."""
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    events = prof.events()
    host = Counter(e.name for e in events)
    kernels = sum(1 for e in events if e.device_type.name == "CUDA")
    return (sum(c for name, c in host.items() if "LaunchKernel" in name) / calls,
            sum(c for name, c in host.items() if "GraphLaunch" in name) / calls, kernels / calls)


@torch.inference_mode()
def launch_counts() -> str:
    """Launches of one decode forward at batch 1, bf16, built-in model: eager and replayed."""
    llm = LLM(device="cuda", dtype="bfloat16", kv_cache_memory_gb=1)
    runner = llm.engine.executor.model_runner
    graphs = runner.backend.forward
    ids, positions, meta = decode_step(runner, 1, 1)
    eager = launches(lambda: graphs.forward(ids, positions, runner.kv_caches, meta))
    replay = launches(lambda: graphs(ids, positions, runner.kv_caches, meta))
    del llm, graphs
    free_cuda_memory()
    for name, (k, g, gpu) in (("eager", eager), ("graph", replay)):
        print(f"decode forward, batch 1, bf16, {name}: {k:.0f} kernel launches, {g:.0f} graph "
              f"launches from the host; {gpu:.0f} kernels seen on the GPU")
    assert replay[1] == 1 and replay[0] < eager[0] / 10, "the replay still launches kernel by kernel"
    return f"launches a decode step {eager[0]:.0f} -> {replay[0]:.0f} + 1 graph"


def graphs(prompts: list[str]) -> str:
    """The section: `prompts`, gpu_smoke's four (the first half of 8 requests)."""
    notes = [replay_equals_eager(dtype, prompts) for dtype in ("float32", "bfloat16")]
    replays = greedy_with_and_without_graphs(prompts)
    return f"replay == eager ({notes[0]}); greedy == eager ({sum(replays.values())} replays); {launch_counts()}"


# ------------------------------------------------------------------------------------ speed


def hf_generate_tok_s(prompt: list[int], new_tokens: int) -> float:
    """HF transformers `generate`, greedy, batch 1, bf16, on bench's checkpoint on this GPU."""
    from transformers import AutoModelForCausalLM

    from nanoserve.tools.bench import make_checkpoint
    model = AutoModelForCausalLM.from_pretrained(str(make_checkpoint())).to("cuda", torch.bfloat16).eval()
    model.generation_config.eos_token_id = None
    ids = torch.tensor([prompt], device="cuda")
    run = lambda n: model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                                   min_new_tokens=n, do_sample=False, pad_token_id=0)
    run(4)
    torch.cuda.synchronize()
    start = time.perf_counter()
    run(new_tokens)
    torch.cuda.synchronize()
    rate = new_tokens / (time.perf_counter() - start)
    del model
    free_cuda_memory()
    return rate


def engine_speeds() -> dict:
    """{(quantization, eager): (batch 1, batch 8, 64 requests) output tok/s}, bench's checkpoint."""
    from nanoserve.tools.bench import make_bench_llm, make_workload, time_workload
    prompts, output_lens = make_workload(64)
    short = [p[:16] for p in prompts[:8]]
    rates = {}
    for q in (None, "fp8", "int8"):
        for eager in (True, False):
            llm = make_bench_llm(dtype="bfloat16", device="cuda", quantization=q, enforce_eager=eager)
            rates[q, eager] = tuple(time_workload(llm, p, n)["output_tok_s"] for p, n in (
                (short[:1], [64]), (short, [64] * 8), (prompts, output_lens)))
            del llm
            free_cuda_memory()
            print(f"{q or 'bfloat16':8} {'eager ' if eager else 'graphs'}: batch 1 {rates[q, eager][0]:7.1f}, "
                  f"batch 8 {rates[q, eager][1]:7.1f}, 64 requests {rates[q, eager][2]:7.0f} output tok/s")
    for q in (None, "fp8", "int8"):
        print(f"{q or 'bfloat16':8} graphs / eager: " + ", ".join(
            f"{g / e:.2f}x" for g, e in zip(rates[q, False], rates[q, True])))
    hf = hf_generate_tok_s(short[0], 64)
    print(f"HF transformers generate, batch 1, bf16: {hf:.1f} tok/s; nanoserve with graphs "
          f"{rates[None, False][0] / hf:.2f}x of it")
    return rates


def llama_8b_shape(num_layers: int, quantization):
    """A Llama-3-8B-shaped model of `num_layers` layers, random weights made on the GPU (bf16; the
    layers' products fp8 where asked), the CUDA backend bound: (model, backend)."""
    from transformers import LlamaConfig

    from nanoserve.backends import torch_gemm_paths
    from nanoserve.config import Config
    from nanoserve.cuda.backend import bind
    from nanoserve.layers import Linear
    from nanoserve.models import get_model_class
    from nanoserve.quantization import quantize
    cfg = LlamaConfig(**LLAMA3_8B, num_hidden_layers=num_layers)
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cuda"):
            model = get_model_class(cfg)(cfg, quantization=quantization).eval()
    finally:
        torch.set_default_dtype(torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.is_floating_point() and p.dtype == torch.bfloat16:
                p.fill_(1.0) if "norm" in name else p.normal_(0.0, 0.02)
        for m in model.modules():
            if isinstance(m, Linear) and m.quantization:
                w = torch.randn(m.out_features, m.in_features, device="cuda") * 0.02
                m.weight.data, m.weight_scale = quantize(w, quantization)
    return model, bind(model, Config(max_num_seqs=1, block_size=16), torch_gemm_paths(model))


@torch.inference_mode()
def time_8b_step(num_layers: int, quantization, seq_len: int = 1024) -> tuple:
    """((wall, GPU) µs eager, (wall, GPU) µs replayed, bytes read) of one batch-1 decode step
    (forward and LM head) at seq_len."""
    from nanoserve.step_inputs import StepInputs
    model, backend = llama_8b_shape(num_layers, quantization)
    blocks = seq_len // 16
    kv = [tuple(torch.randn(blocks, 16, 8, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
          for _ in range(num_layers)]
    inputs = StepInputs(16, 1, blocks + 1, torch.device("cuda"))
    backend.capture(inputs, kv)
    pos = torch.tensor([seq_len - 1])
    table = torch.arange(blocks, dtype=torch.int32)[None]    # the identity: slot == position
    ids, positions, meta, _ = inputs.place(torch.tensor([7]), pos, pos, pos + 1, torch.arange(2),
                                           table, torch.zeros(1), 1, num_rows=1)
    step = lambda forward: model.compute_logits(forward(ids, positions, kv, meta)[:1])
    times = [gpu_us(lambda f=f: step(f), calls=20) for f in (backend.forward.model, backend.forward)]
    weights = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if "embed" not in n)
    kv_bytes = sum(t.numel() * t.element_size() for pair in kv for t in pair)
    del model, backend, kv, inputs
    free_cuda_memory()
    return times[0], times[1], weights + kv_bytes


def llama_8b_speed() -> str:
    """2 and 4 layers timed; 32 layers = 2 layers + 15 x (4 layers - 2 layers), against the bytes
    bound (every weight but the embedding, and the KV cache read, at HBM_BYTES_S)."""
    notes = []
    for q in (None, "fp8"):
        (e2, g2, b2), (e4, g4, b4) = (time_8b_step(n, q) for n in (2, 4))
        at_32 = lambda t2, t4: (t2 + 15 * (t4 - t2)) / 1e3    # ms
        eager, graph, gpu = at_32(e2[0], e4[0]), at_32(g2[0], g4[0]), at_32(g2[1], g4[1])
        bound_ms = (b2 + 15 * (b4 - b2)) / HBM_BYTES_S * 1e3
        print(f"Llama-3-8B shape, {q or 'bf16'}, batch 1, 1024 tokens: wall µs a step at 2 / 4 layers: "
              f"eager {e2[0]:.0f} / {e4[0]:.0f}, graphs {g2[0]:.0f} / {g4[0]:.0f} (GPU {g2[1]:.0f} / {g4[1]:.0f})")
        print(f"  at 32 layers: eager {eager:.2f} ms, graphs {graph:.2f} ms ({1e3 / graph:.0f} tok/s; its "
              f"kernels {gpu:.2f} ms); bytes bound {bound_ms:.2f} ms: graphs at {bound_ms / graph:.0%} of it")
        notes.append(f"8B {q or 'bf16'} {bound_ms / graph:.0%} of bound")
    return ", ".join(notes)


def graph_speed() -> str:
    rates = engine_speeds()
    gain = rates[None, False][0] / rates[None, True][0]
    return f"bf16 batch 1 {rates[None, False][0]:.0f} tok/s ({gain:.1f}x eager); {llama_8b_speed()}"
