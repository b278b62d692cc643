"""make_traces.py: write the example traces in traces/ with the built-in model (nanoserve-tiny).

    python scripts/make_traces.py                          # all three, a few minutes on a CPU
    python scripts/make_traces.py preemption_storm --out /tmp/traces
    nanoserve trace traces/preemption_storm.jsonl          # then watch one

Each trace is one `LLM(**config, trace=path).generate(prompts, params)` call, greedy and
with ignore_eos, so every request runs its full max_tokens and the schedule is the same on
every machine (only the `t` and `duration_s` timings differ). The pools are tiny on purpose
(num_kv_blocks, small max_num_seqs), so that each trace shows one mechanism clearly:

- continuous_batching: 10 stories of different lengths through 4 seats and a 32-token step
  budget: a request finishes, the next one takes its seat in the same step; long prompts
  are prefilled in chunks next to running decodes.
- preemption_storm: 8 requests that each grow to 6 KV blocks, in a pool of 16: the
  last-admitted request is preempted again and again, and resumes from the prefix cache.
- prefix_caching: 8 questions after one shared 51-token system prompt: from the second
  request on, the system prompt's blocks are prefix hits, shared by every running request.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402
from rich.console import Console  # noqa: E402

from nanoserve import LLM, SamplingParams  # noqa: E402
from nanoserve.trace import Trace  # noqa: E402
from nanoserve.tools.replay_plots import summary_table  # noqa: E402

STORIES = ["Once upon a time", "Tom and Lily went to the park", "The little dog was sad because",
           "One day, a girl named Sue found a big red ball in the garden. She",
           "The sun was hot", "Ben had a toy car. He liked to",
           "There was a cat who loved to sleep in the sun all day long. One morning",
           "Mia saw a bird", "The old man smiled and said", "Once upon a time, in a small town,"]
SYSTEM = ("You are a kind teacher who tells short, happy stories to small children. "
          "Use simple words. Every story has a beginning, a middle and an end.\n")
QUESTIONS = ["Tell me about a cat.", "Tell me about a dog.", "Tell me about the sea.",
             "Tell me about a tree.", "Tell me about a ball.", "Tell me about the moon.",
             "Tell me about a frog.", "Tell me about a cake."]

TRACES = {
    "continuous_batching": dict(
        config=dict(block_size=8, num_kv_blocks=64, max_model_len=128, max_num_seqs=4,
                    max_num_batched_tokens=32),
        prompts=STORIES, max_tokens=[12, 30, 8, 20, 36, 10, 16, 24, 6, 28]),
    "preemption_storm": dict(
        config=dict(block_size=8, num_kv_blocks=16, max_model_len=64),
        prompts=STORIES[:8], max_tokens=[40] * 8),
    "prefix_caching": dict(
        config=dict(block_size=8, num_kv_blocks=64, max_model_len=128, max_num_seqs=4),
        prompts=[SYSTEM + q for q in QUESTIONS], max_tokens=[16] * 8),
}


def make_trace(name: str, out_dir: str) -> str:
    spec = TRACES[name]
    # relative: the config event records the path, which should not name this machine's disk
    path = os.path.relpath(os.path.join(out_dir, f"{name}.jsonl"))
    llm = LLM(**spec["config"], trace=path)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
              for n in spec["max_tokens"]]
    llm.generate(spec["prompts"], params, progress=False)
    llm.engine.tracer.close()
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*",
                        help=f"Which traces: {', '.join(TRACES)} (default: all).")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "traces"),
                        help="Directory for the .jsonl files (default: traces/).")
    args = parser.parse_args()
    unknown = set(args.names) - set(TRACES)
    if unknown:
        parser.error(f"no trace named {', '.join(sorted(unknown))} "
                     f"(choose from {', '.join(TRACES)})")
    os.makedirs(args.out, exist_ok=True)
    # One thread: a 2M-parameter model runs faster on one core than split over several,
    # and its step times stay steady when other work shares the machine.
    torch.set_num_threads(1)
    # Warm up first (torch's first steps are slow), so the timings show scheduling, not that.
    LLM().generate(STORIES[:4], SamplingParams(max_tokens=8), progress=False)
    for name in args.names or TRACES:
        path = make_trace(name, args.out)
        print(f"{path}: {os.path.getsize(path) / 1024:.0f} KiB")
        Console().print(summary_table(Trace.load(path)))


if __name__ == "__main__":
    main()
