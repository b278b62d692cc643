"""cpu_step_split.py: where a batch-1 decode step's time goes on the CPU: the products (every
layer's product in the replayed step, and the LM head) against everything else (the rest of the
replay: attention, RoPE, norms, the embedding; and the engine's Python around it: scheduling, the
step's inputs, sampling, the update).

    python scripts/cpu_step_split.py --dtype bfloat16 [--quantization int8] [--tokens 64] [--rounds 3]

A decode step is timed whole: one request of --tokens output tokens, less the same request with
one output token (its prefill), per decode step. The products inside it: each call of the captured
graphs (cpu/graphs.py) that is a product (gemm.c, or a torch product op) is timed as it replays,
and the LM head (eager, after the graph) by hooks on its module. The bench model's shapes
(SmolLM2-135M, random weights; nanoserve.tools.bench). Prints the machine's lscpu line.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from nanoserve import LLM, SamplingParams
from nanoserve.tools.bench import cpu_description, make_checkpoint

PRODUCTS = ("gemm", "gemm_int8", "gemm_amx")   # gemm.c's kernels
PRODUCT_OPS = ("linear", "mm")   # a product left to torch: F.linear, oneDNN, _weight_int8pack_mm


class Clock:
    """Seconds spent in the calls it wraps."""

    def __init__(self):
        self.seconds, self.calls = 0.0, 0

    def wrap(self, call):
        def timed():
            start = time.perf_counter()
            status = call()
            self.seconds += time.perf_counter() - start
            self.calls += 1
            return status
        return timed


def is_product(call) -> bool:
    """A replayed call (a partial, graphs.py's _replay) that multiplies by a weight: a gemm.c
    kernel, or a torch op such as aten::linear or oneDNN's mkldnn::_linear_pointwise."""
    if getattr(call.func, "__name__", None) in PRODUCTS:
        return True
    ops = [a for a in call.args if isinstance(a, torch._ops.OpOverload)]
    return any(word in op._schema.name for op in ops for word in PRODUCT_OPS)


def instrument(llm: LLM) -> tuple[Clock, Clock, Clock]:
    """Clocks on the graphs' products, on their other calls, and on the LM head."""
    runner, products, others, head = llm.engine.executor.model_runner, Clock(), Clock(), Clock()
    graphs = getattr(runner.backend.forward, "graphs", None)
    if not graphs:
        raise SystemExit("no captured graphs (a CPU without the C kernels, or --enforce-eager)")
    for graph, _ in graphs.values():
        graph.calls = [(products if is_product(c) else others).wrap(c) for c in graph.calls]
    started = []
    runner.model.lm_head.register_forward_pre_hook(lambda *_: started.append(time.perf_counter()))

    def stop(*_):
        head.seconds += time.perf_counter() - started.pop()
        head.calls += 1
    runner.model.lm_head.register_forward_hook(stop)
    return products, others, head


def seconds(llm: LLM, prompt: list[int], tokens: int) -> float:
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=tokens)
    start = time.perf_counter()
    llm.generate([{"prompt_token_ids": prompt}], params, progress=False)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--quantization", choices=["int8"])
    parser.add_argument("--quantize-lm-head", action="store_true")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    llm = LLM(str(make_checkpoint()), dtype=args.dtype, quantization=args.quantization,
              quantize_lm_head=args.quantize_lm_head, kv_cache_memory_gb=1, max_model_len=1024, max_num_seqs=8, enable_prefix_caching=False)
    prompt = list(range(100, 132))
    seconds(llm, prompt, args.tokens)                              # warm-up
    products, others, head = instrument(llm)
    rows = []
    for _ in range(args.rounds):
        prefill = seconds(llm, prompt, 1)
        before = (products.seconds, others.seconds, head.seconds, head.calls)
        step = (seconds(llm, prompt, args.tokens) - prefill) / (args.tokens - 1)
        layers = (products.seconds - before[0]) / (args.tokens - 1)
        kernels = (others.seconds - before[1]) / (args.tokens - 1)
        lm_head = (head.seconds - before[2]) / (head.calls - before[3])
        rows.append((step, layers + lm_head, kernels))
    print(cpu_description())
    print(f"{args.dtype}{' int8' if args.quantization else ''}{' (int8 LM head)' if args.quantize_lm_head else ''}"
          f", batch 1, {args.tokens} tokens, {args.rounds} rounds; ms a decode step: whole = products "
          f"(layers + LM head) + the replay's other calls + the rest (the engine's Python)")
    for step, product, kernels in rows:
        print(f"  {step * 1e3:6.2f} = {product * 1e3:6.2f} + {kernels * 1e3:5.2f} + "
              f"{(step - product - kernels) * 1e3:5.2f}")
    median = statistics.median(step - product for step, product, _ in rows)
    print(f"median outside the products: {median * 1e3:.2f} ms a step")


if __name__ == "__main__":
    main()
