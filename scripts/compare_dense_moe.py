"""compare_dense_moe.py: nanoserve on the dense bench model against the mixture of experts of the
same active work, on the same 64-request workload, taking turns (issue 53's "against the dense
model of the same active parameters").

    python scripts/compare_dense_moe.py [--runs 2] [--dtype bfloat16]

The dense model is SmolLM2-135M's shape (an MLP 1536 wide); the MoE (bench.QWEN3_MOE_AT_SMOLLM2)
has 16 experts 384 wide, 4 a token: a token's MLP work is the same, but a batch reads every
expert, four times the dense MLP's weights. Random weights, prefix caching off (as
compare_vllm.py). Prints output tokens/s per run and the MoE/dense ratio of each round.
"""

import argparse

from nanoserve.tools import bench


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    args = parser.parse_args()
    print(f"machine: {bench.cpu_description()}")
    prompts, output_lens = bench.make_workload(64)
    checkpoints = {"dense": bench.make_checkpoint(),
                   "moe": bench.make_checkpoint(bench.MOE_CHECKPOINT, bench.QWEN3_MOE_AT_SMOLLM2)}
    engines = {name: bench.make_bench_llm(str(path), args.dtype, enable_prefix_caching=False)
               for name, path in checkpoints.items()}
    runs = {name: [] for name in engines}
    for round_ in range(args.runs):
        for name in ("dense", "moe") if round_ % 2 == 0 else ("moe", "dense"):
            runs[name].append(bench.time_workload(engines[name], prompts, output_lens)["output_tok_s"])
            print(f"round {round_ + 1} {name}: {runs[name][-1]:.1f} tok/s", flush=True)
    ratios = [moe / dense for moe, dense in zip(runs["moe"], runs["dense"])]
    print("MoE / dense per round: " + ", ".join(f"{r:.3f}" for r in ratios))


if __name__ == "__main__":
    main()
