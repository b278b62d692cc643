"""bench_moe_layers.py: a decode or prefill step's MoE work on the CPU, 30 layers of the bench
MoE in sequence (nanoserve.tools.bench.QWEN3_MOE_AT_SMOLLM2: 16 experts of 384, top-4, hidden
576, bf16, random weights): 637 MB of experts, more than this machine's caches hold, so each
layer's weights come from memory as in the engine (scripts/bench_fused_moe.py times one layer,
whose weights stay in cache). nanoserve's CPU form (cpu/moe.py, the `amx` path), or with --vllm
vLLM-CPU's own kernel (torch.ops._C.cpu_fused_moe on weights prepacked by cpu_prepack_moe_weight),
run by vLLM's Python:

    PYTHONPATH=$PWD python scripts/bench_moe_layers.py [TOKENS ...]
    ~/vllm-venv/bin/python scripts/bench_moe_layers.py --vllm [TOKENS ...]

Prints, for each token count (default 16 64 256 512 2048), the best of a few passes over the 30
layers, each layer on inputs and router logits of its own.
"""

import sys
import time

import torch

LAYERS, EXPERTS, TOP_K, HIDDEN, INTER = 30, 16, 4, 576, 384


def nanoserve_layers():
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent))
    from moe_kit import random_moe
    from nanoserve.config import Config
    from nanoserve.cpu.moe import CpuFusedMoE
    forms = [CpuFusedMoE(random_moe(EXPERTS, TOP_K, HIDDEN, INTER, torch.bfloat16, seed=i), torch.bfloat16,
                         Config(cpu_gemm="amx"), {}) for i in range(LAYERS)]
    return [lambda x, logits, f=f: f.forward(x, logits) for f in forms]


def vllm_layers():
    import vllm._custom_ops as ops
    torch._C._cpu._init_amx()   # Linux's permission for the AMX tiles, as vLLM's engine asks
    layers = []
    for i in range(LAYERS):
        g = torch.Generator().manual_seed(i)
        w13 = (torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=g) * HIDDEN**-0.5).bfloat16()
        w2 = (torch.randn(EXPERTS, HIDDEN, INTER, generator=g) * INTER**-0.5).bfloat16()
        layers.append((ops.cpu_prepack_moe_weight(w13, "amx"), ops.cpu_prepack_moe_weight(w2, "amx")))

    def form(x, logits, w13, w2):
        weights, ids = logits.softmax(-1).topk(TOP_K)
        out = torch.empty_like(x)
        ops.cpu_fused_moe(out, x, w13, w2, None, None, weights / weights.sum(-1, keepdim=True),
                          ids.to(torch.int32), "silu", "amx")
        return out
    return [lambda x, logits, w=w: form(x, logits, *w) for w in layers]


@torch.inference_mode()
def main() -> None:
    args = sys.argv[1:]
    vllm = "--vllm" in args
    layers = vllm_layers() if vllm else nanoserve_layers()
    for tokens in [int(a) for a in args if a != "--vllm"] or (16, 64, 256, 512, 2048):
        g = torch.Generator().manual_seed(tokens)
        inputs = [(torch.randn(tokens, HIDDEN, generator=g).bfloat16(), torch.randn(tokens, EXPERTS, generator=g))
                  for _ in range(LAYERS)]
        best = float("inf")
        for _ in range(4 if tokens > 256 else 8):
            start = time.perf_counter()
            for layer, (x, logits) in zip(layers, inputs):
                layer(x, logits)
            best = min(best, time.perf_counter() - start)
        print(f"{'vLLM cpu_fused_moe' if vllm else 'nanoserve moe_amx'}: {tokens:5} tokens x {LAYERS} layers "
              f"{best * 1e3:8.2f} ms ({best / LAYERS * 1e3:.3f} ms a layer)")


if __name__ == "__main__":
    main()
