"""bench_fused_moe.py: the CPU form of FusedMoE (nanoserve/cpu/moe.py) against its torch reference
(layers.FusedMoE.forward_native), timed in one process, the two taking turns, on this CPU.

The shape: a Qwen3-MoE layer at SmolLM2-135M's width (hidden 576, 16 experts, top-4,
moe_intermediate 384), random weights; 1, 8 and 64 tokens (decode batches, a short prefill);
float32, bf16, and int8 weights (--quantization int8) in bf16. The CPU form's product paths are
chosen by its own start-up timing (gemm.py), as the engine would choose them.

    PYTHONPATH=$PWD python scripts/bench_fused_moe.py [--repeats 30]

Prints the CPU's model name and flags (lscpu), the paths chosen, and for each case both times (best of
the repeats) and the ratio reference / CPU form (above 1: the CPU form is faster).
"""

import argparse
import copy
import time

import torch

from moe_kit import random_moe   # (this script's folder is on sys.path)

from nanoserve.config import Config
from nanoserve.cpu.moe import CpuFusedMoE
from nanoserve.tools.bench import cpu_description

HIDDEN, EXPERTS, TOP_K, INTERMEDIATE = 576, 16, 4, 384
TOKENS = (1, 8, 64)


def best_seconds(forms: dict, args: tuple, repeats: int) -> dict[str, float]:
    """Each form's best time on args, the forms taking turns (a burst of load hits both)."""
    best = dict.fromkeys(forms, float("inf"))
    for name, form in forms.items():
        form(*args)     # warm: oneDNN and the allocator's first calls
    for _ in range(repeats):
        for name, form in forms.items():
            start = time.perf_counter()
            form(*args)
            best[name] = min(best[name], time.perf_counter() - start)
    return best


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=30)
    repeats = parser.parse_args().repeats
    print(f"CPU: {cpu_description()}; {torch.get_num_threads()} threads, torch {torch.__version__}")
    print(f"FusedMoE hidden {HIDDEN}, {EXPERTS} experts, top-{TOP_K}, intermediate {INTERMEDIATE}")
    for label, dtype, quantization in (("float32", torch.float32, None), ("bf16", torch.bfloat16, None),
                                       ("int8 (bf16)", torch.bfloat16, "int8")):
        reference = random_moe(EXPERTS, TOP_K, HIDDEN, INTERMEDIATE, dtype, quantization)
        ours, paths = copy.deepcopy(reference), {}
        form = CpuFusedMoE(ours, dtype, Config(), paths)
        print(f"\n{label}: paths {paths}")
        for tokens in TOKENS:
            g = torch.Generator().manual_seed(tokens)
            args = (torch.randn(tokens, HIDDEN, generator=g).to(dtype), torch.randn(tokens, EXPERTS, generator=g))
            seconds = best_seconds({"reference": reference.forward_native, "cpu": form.forward}, args, repeats)
            print(f"  {tokens:3} tokens: forward_native {seconds['reference'] * 1e3:7.3f} ms, "
                  f"cpu form {seconds['cpu'] * 1e3:7.3f} ms, ratio {seconds['reference'] / seconds['cpu']:5.2f}x")


if __name__ == "__main__":
    main()
