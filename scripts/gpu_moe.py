"""gpu_moe.py: scripts/gpu_smoke.py's `fused-moe` section (nanoserve/cuda/fused_moe_triton.py), kept
here so that gpu_smoke.py does not grow. Run it through gpu_smoke:

    python scripts/gpu_smoke.py fused-moe        # from the repository root, on a CUDA GPU

At Qwen3-30B-A3B's MoE layer (hidden 2048, 128 experts, top-8, moe_intermediate 768; random
weights built on the GPU) and 1, 64 and 512 tokens: the Triton form == FusedMoE.forward_native (its
max error over the reference's max magnitude) in bf16, in float32 at 64 tokens, and with int8 and
fp8 weights at 64 tokens; and in bf16 the time of a call of each (wall µs, back to back: the
reference's per-expert loop syncs on every nonzero) and their ratio.

Returns its one-line note for gpu_smoke's summary and raises where a check fails.
"""

import functools

import torch
import moe_kit  # (scripts/ is on sys.path)
from gpu_graphs import free_cuda_memory, gpu_us

from nanoserve.layers import FusedMoE

QWEN3_30B_A3B = dict(num_experts=128, top_k=8, hidden_size=2048, intermediate_size=768)
TOKENS = (1, 64, 512)
# bf16: the rounding of each product's output and of silu (forward_native's) against float32 sums
# rounded once; a quantized weight: scaled after the sums, not dequantized to bf16 first.
TOL = {"bfloat16": 2e-2, "float32": 1e-4, "int8": 2e-2, "fp8": 2e-2}


def random_moe(dtype: torch.dtype, quantization=None) -> FusedMoE:
    """Qwen3-30B-A3B's layer with random weights on the GPU (moe_kit.py)."""
    return moe_kit.random_moe(**QWEN3_30B_A3B, dtype=dtype, quantization=quantization, device="cuda")


def bound(op: FusedMoE):
    """op's Triton form, as cuda/backend.bind gives it."""
    from nanoserve.cuda.fused_moe_triton import expert_map, fused_moe_triton
    return functools.partial(fused_moe_triton, op, expert_map(op))


def inputs(op: FusedMoE, tokens: int, dtype: torch.dtype, device="cuda"):
    g = torch.Generator(device=device).manual_seed(tokens)
    hidden = torch.randn(tokens, op.w13_weight.shape[2], generator=g, device=device).to(dtype)
    return hidden, torch.randn(tokens, op.num_experts, generator=g, device=device).to(dtype)


def relative_error(op: FusedMoE, tokens: int, dtype: torch.dtype, device="cuda") -> float:
    """max |Triton - forward_native| / max |forward_native|."""
    hidden, logits = inputs(op, tokens, dtype, device)
    expected = op.forward_native(hidden, logits).float()
    return ((bound(op)(hidden, logits).float() - expected).abs().max() / expected.abs().max()).item()


def bf16_ratios(errors: dict[str, float]) -> list[float]:
    """In bf16, at each of TOKENS: the error into `errors`; returns the per-expert loop's time over
    the Triton form's."""
    op, ratios = random_moe(torch.bfloat16), []
    for tokens in TOKENS:
        errors[f"bfloat16 {tokens}"] = relative_error(op, tokens, torch.bfloat16)
        args = inputs(op, tokens, torch.bfloat16)
        ours, reference = gpu_us(lambda: bound(op)(*args))[0], gpu_us(lambda: op.forward_native(*args), 10)[0]
        ratios.append(reference / ours)
        print(f"bf16 {tokens:3} tokens: Triton {ours:8.1f} µs, per-expert loop {reference:8.1f} µs "
              f"({reference / ours:.1f}x); error {errors[f'bfloat16 {tokens}']:.1e}")
    return ratios


@torch.inference_mode()
def fused_moe() -> str:
    errors = {}
    ratios = bf16_ratios(errors)
    free_cuda_memory()
    for name, dtype, quantization in (("float32", torch.float32, None), ("int8", torch.bfloat16, "int8"),
                                      ("fp8", torch.bfloat16, "fp8")):
        errors[f"{name} 64"] = relative_error(random_moe(dtype, quantization), 64, dtype)
        print(f"{name} 64 tokens: error {errors[f'{name} 64']:.1e}")
        free_cuda_memory()
    for case, err in errors.items():
        assert err <= TOL[case.split()[0]], f"{case} tokens: error {err:.2e}"
    return (f"max err {max(errors.values()):.0e}; bf16 "
            + ", ".join(f"{t} tok {r:.1f}x" for t, r in zip(TOKENS, ratios)) + " the per-expert loop")
