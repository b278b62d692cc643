"""The published line budget (README): nanoserve stays small enough to read in an afternoon.
Each layer file must fit in one sitting, and the whole package under a fixed total."""

from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "nanoserve"
MAX_LINES_PER_FILE = 400
# 5,000 until this round's capabilities needed room of their own: the CPU GEMM paths
# (models/linear.py: oneDNN packing chosen by timing at start-up), the serving benchmark client
# (bench_serve.py), the engine core in its own process (core_client.py, engine_core.py) and
# tensor parallel. 6,500 -> 6,600 for the CPU kernels' Python side (cpu_kernels.py calls six C
# kernels now: prefill attention, RMSNorm with the residual add, RoPE with store_kv, silu_and_mul,
# the greedy argmax, beside decode attention; the C itself is not counted) and vLLM's residual
# layout in llama.py.
# 6,600 -> 6,700 for the C GEMM (csrc/gemm.c), a fourth CPU product path that start-up timing can
# pick: its packing and call in cpu_kernels.py, KernelGemm in models/linear.py.
# 6,700 -> 6,750 for the AMX path (bf16 on Sapphire Rapids and later): AmxGemm and the start-up
# measurement of its crossover to F.linear in models/linear.py, its call in cpu_kernels.py.
# 6,750 -> 6,800 for gemm.c's gate_up product ending in silu(gate) * up: the panel order of the
# gate and up rows (cpu_kernels.py) and Linear's silu_and_mul on every path (models/linear.py).
# 6,800 -> 6,825 for the RMSNorm inside the AMX product too (AmxGemm's norm and its F.linear
# fallback, the shared checks of a norm's arguments in cpu_kernels.py).
# 6,825 -> 6,850 for the AMX product's own silu_and_mul (AmxGemm's, its crossover timed on the
# layer as it runs, the pass after F.linear shared by every path) and the greedy argmax on bf16
# logits (cpu_kernels.py, the sampler's float32 only where a stage computes).
# 6,850 -> 6,875 for less Python between the C kernels (in the engine, with its caches cold, ~4.9 ->
# ~4.0 ms of a 54 ms bf16 decode step): each step's attention arguments taken once
# (paged_attention.RequestGroup.arguments), the model's modules called without nn.Module's hooks.
# 6,875 -> 7,025 for the CPU decode plan (models/decode_plan.py, 160 lines): a decode step as one flat
# loop of C calls, the job CUDA graphs do in vLLM; ~1.04x the 64-request workload in bf16 and float32.
MAX_LINES_TOTAL = 7025


def test_line_budget():
    sizes = {p.relative_to(PACKAGE.parent).as_posix(): len(p.read_text().splitlines())
             for p in PACKAGE.rglob("*.py")}
    too_long = {name: n for name, n in sizes.items() if n > MAX_LINES_PER_FILE}
    assert not too_long, f"over {MAX_LINES_PER_FILE} lines: {too_long}"
    assert sum(sizes.values()) <= MAX_LINES_TOTAL, sizes
