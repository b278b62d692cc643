"""The published line budgets (README): nanoserve stays small enough to read in an afternoon.

The teaching core (nanoserve/ without the backends cpu/ and cuda/, and without tools/) is what
the lessons cite, so it has the tightest budget. Each backend (the CPU's Python and C, the CUDA
backend's Triton kernels) and the tools have budgets of their own, so that speed code and
utilities never spill into the core. Every file fits in one sitting and every
function on one screen.

Raising a budget needs its reason in the same commit, written as a comment beside the constant.
"""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "nanoserve"
CPU_BACKEND = PACKAGE / "cpu"
CUDA_BACKEND = PACKAGE / "cuda"
TOOLS = PACKAGE / "tools"

# The core's budget: 5,000 lines for the engine the lessons first taught, plus one named share per
# capability added since, each with its reason (a capability raises only its own share).
CORE_CAPABILITY_BUDGETS = {
    # issue 39: data parallel: one engine core per DP rank behind one ROUTER socket, the load
    # balancing and routing of aborts, --headless hosts over TCP with their supervision (pings,
    # the disconnect event), the Config fields and their checks, per-rank /metrics.
    "data_parallel": 270,
    # issue 41: structured outputs with xgrammar: structured_output.py (compile, matchers, the
    # step's bitmask) ~180, the request fields in protocol.py and sampling_params.py ~110, the
    # front ends and the API ~35, the bitmask in the engine core, runner and sampler ~70, the
    # trace event ~10 (412 lines in all).
    "structured_outputs": 415,
    # issue 43: model_runner.batch_indices, the flat batch's indices as a function the runner holds
    # as an attribute, so that lesson 2's exercise 2.4 runs the real engine with a student's own
    # positions, slot_mapping and query_start_loc (an attribute, not a hidden global).
    "lesson_exercise_hooks": 15,
    # issue 42: speculative decoding (n-gram): spec_decode.py (proposer, verification rows, the
    # acceptance rule, ~115), SpeculativeConfig (~65), draft budgeting and roll-back in the
    # scheduler (~70), k + 1 verified positions in the runner (~20), the spec_decode trace event
    # and its replay (~30), the counters for /metrics (~20)
    "speculative_decoding": 330,
    # issue 40: --quantization int8|fp8 at load: quantization.py (quantize, dequantize, the checks,
    # the sizing), the quantized Linear and its reference, the loader quantizing each slice as read,
    # the Config field, and the backend seam's one log line. + 15 for issue 52's opt-in quantized
    # LM head (--quantize-lm-head: the field and its check, the head's Linear, a tied head filled
    # from the embedding), which llama.cpp's Q8_0 has.
    "quantization": 160,
    # issue 52: CUDA graphs' share of the core: step_inputs.py (the persistent step inputs, one
    # copy a step, the padding of a decode step to a captured size ~130), the two Config fields
    # and vLLM's default sizes (~30), the runner's placing of its inputs and the capture call,
    # the Backend's two fields, the reference store skipping padded slots (~20). + 80 in its second
    # round: graph_capture.py, the capture-and-replay protocol both backends share (GraphWrapper,
    # moved out of cuda/graphs.py when the CPU got its own capture: which steps replay and why).
    # + 15 for the step's one sync (tests/test_step_syncs.py): the sampling metadata and the
    # grammar bitmask built on the host and copied without waiting (sampler.to_device), the
    # logprobs fetched in the sampled ids' one copy (SamplerOutput.tolists) instead of two more.
    "cuda_graphs": 275,
    # issue 51: safe on a network: serial_utils.py (typed msgspec messages, HMAC-signed frames
    # with a session handshake against replay, drops logged; ~325) and core_client.py's use of it,
    # the rpc secret and the every-rank watchdog (~35); http_limits.py (Host check, CORS, the
    # request-head deadline; ~75) and the body's content type, depth, NaN and cap checks in
    # protocol.py and api.py (~170); tokenizing off the event loop, the character cap and
    # admission by sequences (~70); grammar limits, the bounded compile pool with its timeout and
    # WAITING_FOR_FSM (~190); per-request failure isolation in the sampler, runner and engine core
    # (~100); the TP step watchdog, the loopback rendezvous, serve exiting on engine death (~85).
    "network_safety": 900,
    # issue 53: mixture of experts: FusedMoE and select_experts, the op and its router with their
    # torch reference, FusedMoE.route with vLLM's custom_routing_function hook (layers.py, ~75);
    # models/mixture_of_experts.py, Qwen3-MoE and Mixtral on llama.py's layers, the hub's
    # per-expert checkpoint layout, experts sliced under TP or shared out whole under expert
    # parallel (~145); the model-geometry seam the engine now reads every family through, so that
    # a new family is a module and a registry line: models/geometry.py (~45),
    # verify_with_parallel_config and the registry's lines (~25), Attention's sizes and
    # model_dtype for binding by type (~10), the per-rank sizing (~10); enable_expert_parallel in
    # Config, TensorParallel and the worker (~15); llama.py's make_mlp and the loader's
    # never-read targets and scales beside any quantized weight (~5); the trace's expert_load
    # event and its reading (~15), expert_load.py (the router logits kept at fixed addresses and
    # counted after the step, ~60) and its way from the runner to the tracer (~15). + 26 for the
    # activation estimate of a MoE block (model_loader.py, the pairs' caches, ~13) and the
    # experts' shape read once for every family (geometry.py's get_moe_shape, ~13). + 2: the
    # dense MLP's split checked where it is built (make_mlp), so Mixtral's whole experts need none.
    # + 230 for data parallel + expert parallel: the exchange (ExpertExchange: the counts once a
    # forward, dispatch, combine), the lockstep check and the group's join in distributed.py
    # (~95); the lockstep, idle wait and dummy steps in engine_core.py, executor.py and
    # model_runner.py, with how a dead peer is handled (~90); the experts split over the DP
    # ranks, verify_with_parallel_config's DP size (~25); Config's checks (~20).
    "mixture_of_experts": 683,
    # issue 54: `nanoserve serve`'s start-up line with the KV pool in tokens and the maximum
    # concurrency for max_model_len, the two numbers vLLM logs (the clinic, lessons/10).
    "clinic_startup_line": 5,
}
CORE_BUDGET = 5000 + sum(CORE_CAPABILITY_BUDGETS.values())
# ~1,730 lines of C, ~1,050 of Python (the ops, products, then a fused step); + 250 for issue 40's int8
# products (gemm.c's gemm_int8 in registers and on widened panels, its packing, torch's
# _weight_int8pack_mm and the dequantizing path, timed at start-up like the others).
# + 175 for issue 52's capture and replay on the CPU: graphs.py (~360: the recorder of C calls and
# torch ops, the norm and silu folding passes, the memory plan into one arena, the replay) in place
# of fused.py's hand-written forward (~190). - 265 when those two folding passes lost their A/B
# (1.037x and 1.024x faster without them) and went, with all that only they used: gemm.c's norm
# while copying and silu epilogues, the gate_up packing, the wrappers' arguments (274 lines; the
# backend had been 8 over).
# + 130 for issue 53's FusedMoE form: moe.py (~80: the tokens grouped by expert, each expert's
# products on gemm.py's timed paths), graphs.py's opaque call (~40: a data-dependent op recorded
# as one call, so a MoE model's decode step still replays), gemm.py's path choice shared (~10).
# + 190 for issue 53's second round: gemm.c's moe_amx (~170: a layer's experts in one parallel
# region, the pairs sorted by expert and their rows gathered in C, each thread one stream across the
# stacked experts' weights, every row count on the AMX loop, the weighted sum with index_add_'s
# roundings; gemm_amx's packing and passes shared with it) and its wrapper in kernels.py (~20).
# + 5: Qwen3's q and k norms on rms_norm.c (a view of qkv's columns copied contiguous first).
# + 5: gemm.c's AMX packing by 16 x 16 transposes in registers.
# + 10: moe_amx's weighted sum a token at a time (each out row written once, its pairs by expert).
CPU_BACKEND_BUDGET = 3500
# The Triton kernels and their binding: backend forms of the seam (layers.py) as cpu/ holds the
# C ones, so they count here and not in the core (whose torch reference is paged_attention.py).
# + 120 for issue 52's CUDA graphs (graphs.py: capture per batch size, replay, which steps go
# eager and why; bind's wrapping of the forward). + 450 for issue 52's Triton forms of the other
# ops: norm_rope_triton.py (RMSNorm with its residual add, RoPE with the K/V store),
# activation_triton.py (silu·mul, fp8 per-token activation quantization), decode_attention_triton.py
# (split-K decode and its reduction), and bind's wiring and warm-up of them all. - 65 when the
# graphs' wrapper moved to the core (graph_capture.py), which the CPU's capture shares.
# + 170 for issue 53's fused MoE: fused_moe_triton.py (~155: moe_align_block_size, the grouped
# GEMM kernel with int8 / fp8 weights scaled per channel, its launcher and the op's forward) and
# bind's binding and warm-up of it at both tiles (~15).
CUDA_BACKEND_BUDGET = 1075
# + 90 for issue 55's figures in Japanese: figure_text.py (~80, most of it the table of every
# figure's words in English and Japanese, and the Japanese font's set-up) and --lang in replay_plots.
TOOLS_BUDGET = 1840
MAX_LINES_PER_FILE = 400
MAX_LINES_PER_FUNCTION = 60


def lines(path: Path) -> int:
    return len(path.read_text().splitlines())


def name(path: Path) -> str:
    return path.relative_to(PACKAGE.parent).as_posix()


def files(root: Path, *suffixes: str) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.suffix in suffixes)


def core_files() -> list[Path]:
    return [p for p in files(PACKAGE, ".py")
            if not any(p.is_relative_to(d) for d in (CPU_BACKEND, CUDA_BACKEND, TOOLS))]


def check_budget(paths: list[Path], budget: int, what: str) -> None:
    sizes = {name(p): lines(p) for p in paths}
    total = sum(sizes.values())
    biggest = sorted(sizes.items(), key=lambda item: -item[1])[:5]
    assert total <= budget, f"{what}: {total} lines, budget {budget}; biggest files: {biggest}"


def test_core_budget():
    check_budget(core_files(), CORE_BUDGET, "teaching core (nanoserve/ without cpu/, cuda/, tools/)")


def test_cpu_backend_budget():
    check_budget(files(CPU_BACKEND, ".py", ".c", ".h"), CPU_BACKEND_BUDGET,
                 "CPU backend (nanoserve/cpu/, Python and C)")


def test_cuda_backend_budget():
    check_budget(files(CUDA_BACKEND, ".py"), CUDA_BACKEND_BUDGET, "CUDA backend (nanoserve/cuda/)")


def test_tools_budget():
    check_budget(files(TOOLS, ".py"), TOOLS_BUDGET, "tools (nanoserve/tools/)")


def test_file_length():
    too_long = {name(p): lines(p) for p in files(PACKAGE, ".py") if lines(p) > MAX_LINES_PER_FILE}
    assert not too_long, f"files over {MAX_LINES_PER_FILE} lines: {too_long}"


def test_function_length():
    """Every def, nested ones and methods included, from `def` to its last line (decorators not
    counted); Triton kernels too."""
    too_long = {}
    for path in files(PACKAGE, ".py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_LINES_PER_FUNCTION:
                    too_long[f"{name(path)}:{node.lineno} {node.name}"] = n
    assert not too_long, f"functions over {MAX_LINES_PER_FUNCTION} lines: {too_long}"
