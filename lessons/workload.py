"""workload.py: run a batch of requests through nanoserve and print what the engine did.

The lessons' experiment bench. `nanoserve generate` runs one prompt; scheduling shows only
when many requests compete, so this script submits a whole batch at once to the engine
(the built-in model, nanoserve-tiny, unless --model says otherwise), steps it until every
request finishes, and reports steps, preemptions, prefix-cache hits, the KV pool at its
fullest and the time per step:

    python lessons/workload.py --num-prompts 8 --prompt-len 24 --max-tokens 40 \
        --block-size 8 --num-kv-blocks 16 --max-model-len 64 --trace /tmp/storm.jsonl
    nanoserve trace /tmp/storm.jsonl --step 18          # then replay what happened

Prompts are token ids, not text: the scheduler only ever sees lengths, so fixing the lengths
fixes the schedule. Each prompt is `--shared-prefix` tokens common to all prompts (think:
a system prompt) followed by `--prompt-len` tokens of its own (`--shared-last` swaps the
order). Every request ignores EOS, so it runs exactly its max_tokens and the same command
gives the same schedule on every machine; only the timings differ. `--prompt TEXT` (repeat
it) runs text prompts instead, and `--show` prints what each request generated.
`--json-schema SCHEMA` constrains every output to a JSON schema (structured outputs: a
request then ends when its JSON is complete).

Every Config field is a flag, as for `nanoserve generate` (--block-size, --num-kv-blocks,
--max-num-seqs, --max-num-batched-tokens, --no-enable-prefix-caching, --trace, ...).

Your own code in the real engine: `--scheduler`, `--waiting-queue` and `--block-pool` take
FILE.py:NAME (or MODULE:NAME) and put that class in place of nanoserve's before the first
request (the exercises' classes fit as they are). Trace both runs and compare them:

    python lessons/workload.py --num-prompts 8 --prompt-len 24 --max-tokens 40 --block-size 8 \
        --num-kv-blocks 16 --max-model-len 64 --trace /tmp/lru.jsonl
    python lessons/workload.py --num-prompts 8 --prompt-len 24 --max-tokens 40 --block-size 8 \
        --num-kv-blocks 16 --max-model-len 64 --trace /tmp/hits.jsonl \
        --block-pool lessons/solutions/lesson5_hit_count_eviction.py:HitCountBlockPool
    nanoserve trace /tmp/hits.jsonl --compare /tmp/lru.jsonl
"""

from __future__ import annotations

import argparse
import importlib
import math
import os
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from check_kit import load  # noqa: E402  (lessons/, this file's folder, is on sys.path)
from nanoserve import LLM, Config, SamplingParams  # noqa: E402
from nanoserve.sampling_params import StructuredOutputsParams  # noqa: E402


def cycled(text: str, kind: type, name: str) -> list:
    """'0,0.8' -> [0.0, 0.8]: a per-request value, cycled over the requests."""
    try:
        return [kind(v) for v in text.split(",")]
    except ValueError:
        raise ValueError(f"{name} must be a number or a list such as 1,2 (got {text!r})") from None


def make_prompts(args, vocab_size: int) -> list:
    """Token-id prompts: a shared part and an own part, drawn from fixed seeds (never id 0,
    the built-in model's EOS and padding token)."""
    if args.prompt:
        return list(args.prompt)
    shared = random.Random(-1).choices(range(1, vocab_size), k=args.shared_prefix)
    prompts = []
    for i in range(args.num_prompts):
        own = random.Random(i).choices(range(1, vocab_size), k=args.prompt_len)
        prompts.append({"prompt_token_ids": own + shared if args.shared_last else shared + own})
    return prompts


def load_name(spec: str, flag: str):
    """'path/to/file.py:Name' or 'package.module:Name' -> that object."""
    module, _, name = spec.rpartition(":")
    if not module or not name.isidentifier():
        raise ValueError(f"{flag} must be FILE.py:NAME or MODULE:NAME (got {spec!r})")
    if module.endswith(".py"):
        if not os.path.isfile(module):
            raise ValueError(f"{flag}: no file {module}")
        found = load(Path(module))
    else:
        sys.path.insert(0, os.getcwd())      # a module of yours, next to where you run this
        found = importlib.import_module(module)
    if not hasattr(found, name):
        raise ValueError(f"{flag}: {module} defines no {name}")
    return getattr(found, name)


def install(llm: LLM, args) -> None:
    """Put the learner's classes in place of the engine's own, before any request arrives:
    a Scheduler subclass, a waiting queue, a BlockPool subclass (built as nanoserve builds
    its own, so they see the same config and report to the same trace)."""
    core = llm.engine
    if args.scheduler:
        cls = load_name(args.scheduler, "--scheduler")
        core.scheduler = cls(core.config, core.kv_cache_manager, core.tracer)
    if args.waiting_queue:
        core.scheduler.waiting = load_name(args.waiting_queue, "--waiting-queue")()
    if args.block_pool:
        cls = load_name(args.block_pool, "--block-pool")
        core.kv_cache_manager.pool = cls(core.config.num_kv_blocks,
                                         core.config.enable_prefix_caching, tracer=core.tracer)


class Probe:
    """Times the parts of each engine step and records the KV pool as each step runs, by
    wrapping the engine's own methods (the engine itself is unchanged)."""

    def __init__(self, llm: LLM):
        core = llm.engine
        self.scheduler, self.pool = core.scheduler, core.kv_cache_manager.pool
        self.seconds: dict[str, float] = {}
        self.steps: list[tuple[int, int, int, int]] = []   # (requests, tokens, blocks, held)
        self.first_token: dict[str, float] = {}    # request id -> time of its first token
        self.finished: dict[str, float] = {}
        self._wrap(core.scheduler, "schedule", "schedule", self._record)
        runner = core.executor.model_runner     # the engine's own, in this process
        self._wrap(runner, "prepare_inputs", "prepare inputs")
        self._wrap(runner.backend, "forward", "forward")    # the model, or its graphs (replays)
        self._wrap(runner, "sampler", "sample")
        self._wrap(core.scheduler, "update", "update", self._tokens)
        self.start = time.perf_counter()

    def _wrap(self, obj, name: str, label: str, after=None) -> None:
        inner = getattr(obj, name)
        self.seconds[label] = 0.0       # the report lists the parts in the order they run

        def timed(*args, **kwargs):
            start = time.perf_counter()
            result = inner(*args, **kwargs)
            self.seconds[label] += time.perf_counter() - start
            if after:
                after(result)
            return result
        setattr(obj, name, timed)

    def _record(self, out) -> None:
        if out.requests:
            # After schedule(), num_computed_tokens counts this step's tokens: the slots in use.
            held = sum(r.num_computed_tokens for r in self.scheduler.running)
            self.steps.append((len(out.requests), out.total_num_scheduled_tokens,
                               self.pool.num_blocks - self.pool.num_free_blocks, held))

    def _tokens(self, outputs) -> None:
        now = time.perf_counter() - self.start
        for o in outputs:
            self.first_token.setdefault(o.request_id, now)
            if o.finish_reason:
                self.finished[o.request_id] = now


def p50_p90(seconds: list[float]) -> str:
    """Nearest-rank percentiles in ms: p50 of 8 values is the 4th smallest, p90 the 8th."""
    v = sorted(seconds)
    return " / ".join(f"{v[max(0, math.ceil(q * len(v)) - 1)] * 1e3:.0f}" for q in (0.5, 0.9))


def report(llm: LLM, probe: Probe, outs, seconds: float, show: bool) -> None:
    cfg, kv, sched = llm.config, llm.engine.kv_cache_manager, llm.engine.scheduler
    prompt_lens = sorted({len(o.prompt_token_ids) for o in outs})
    output_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    # The last sampled token is never fed back: a request needs prompt + output - 1 tokens' K/V.
    needed = sum(len(o.prompt_token_ids) + len(o.outputs[0].token_ids) - 1 for o in outs)
    computed = sum(s[1] for s in probe.steps)
    n = len(probe.steps)
    print(f"workload      {len(outs)} requests, prompts of {'/'.join(map(str, prompt_lens))} "
          f"tokens, {output_tokens} output tokens in all")
    print(f"engine        block_size {cfg.block_size}, {cfg.num_kv_blocks} KV blocks, max_num_seqs "
          f"{cfg.max_num_seqs}, max_num_batched_tokens {cfg.max_num_batched_tokens}")
    print(f"steps         {n}: {sum(s[0] for s in probe.steps) / n:.1f} requests and "
          f"{computed / n:.1f} tokens per step on average")
    # Every token a request needs was computed once, or found in the prefix cache, and every
    # token a preemption dropped was needed once more: computed + hits = needed + dropped
    # (+ the rejected drafts under speculative decoding, computed for nothing).
    hits = kv.prefix_cache_hits
    print(f"tokens        {computed} computed + {hits} from the prefix cache, for {needed} of "
          f"prompts and outputs")
    rejected = 0
    if sched.proposer is not None:      # speculative decoding (lesson 8)
        c = sched.spec_counts
        rejected = c["num_draft_tokens"] - c["num_accepted_tokens"]
        print(f"speculation   {c['num_accepted_tokens']} of {c['num_draft_tokens']} draft tokens "
              f"accepted in {c['num_drafts']} verifying steps; {rejected} rejected (computed, "
              f"then taken back)")
    print(f"preemptions   {sched.num_preemptions_total}, which dropped "
          f"{computed + hits - needed - rejected} computed tokens")
    if cfg.enable_prefix_caching:
        rate = hits / max(kv.prefix_cache_queries, 1)
        print(f"prefix cache  {hits} of {kv.prefix_cache_queries} prompt tokens hit ({rate:.1%})")
    else:
        print("prefix cache  off")
    reqs, _, blocks, held = max(probe.steps, key=lambda s: (s[2], s[3]))
    slots, reserved = blocks * cfg.block_size, reqs * cfg.max_model_len
    shared = ": blocks are shared" if held > slots else ""
    print(f"KV at peak    {blocks} of {cfg.num_kv_blocks} blocks = {slots} slots for {held} "
          f"tokens of {reqs} request(s) ({held / slots:.0%} used{shared})")
    print(f"contiguous    max_model_len {cfg.max_model_len} reserved per request: {reserved} "
          f"slots ({held / reserved:.0%} used)")
    print(f"latency (ms)  first token p50 / p90 {p50_p90(list(probe.first_token.values()))}, "
          f"whole request {p50_p90(list(probe.finished.values()))}")
    print(f"time          {seconds:.2f} s, {output_tokens / seconds:.0f} output tokens/s")
    print("per step (ms) " + ", ".join(f"{k} {v / n * 1e3:.2f}" for k, v in probe.seconds.items()))
    if show:
        for o in outs:
            c = o.outputs[0]
            print(f"request {o.request_id}: {c.text!r}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-prompts", type=int, default=8, help="How many requests.")
    parser.add_argument("--prompt-len", type=int, default=16, help="Own tokens of each prompt.")
    parser.add_argument("--shared-prefix", type=int, default=0,
                        help="Tokens every prompt shares, placed first (a system prompt).")
    parser.add_argument("--shared-last", action="store_true",
                        help="Put the shared tokens after each prompt's own part instead.")
    parser.add_argument("--prompt", action="append", metavar="TEXT",
                        help="A text prompt (repeat for more); replaces the token prompts.")
    parser.add_argument("--max-tokens", default="32",
                        help="Output tokens per request; a list such as 8,40 is cycled.")
    parser.add_argument("--temperature", default="0",
                        help="0 = greedy; a list such as 0,0.8 is cycled over the requests.")
    parser.add_argument("--request-seed", default=None, help="Each request's own seed (same "
                        "seed, same tokens); a list such as 1,2 is cycled.")
    parser.add_argument("--show", action="store_true", help="Print what each request generated.")
    parser.add_argument("--json-schema", metavar="SCHEMA", help="Structured outputs: every "
                        "request's output must match this JSON schema (JSON text).")
    for flag, what in (("--scheduler", "a Scheduler subclass"),
                       ("--waiting-queue", "a waiting queue (add, peek, pop, remove, len, iter)"),
                       ("--block-pool", "a BlockPool subclass")):
        parser.add_argument(flag, metavar="FILE.py:NAME", help=f"Run with {what} of yours "
                            "instead of nanoserve's (or MODULE:NAME).")
    Config.add_cli_args(parser)
    args = parser.parse_args()
    if args.num_prompts < 1:
        parser.error(f"--num-prompts must be at least 1 (got {args.num_prompts})")
    try:
        llm = LLM(**vars(Config.from_cli_args(args)))
        install(llm, args)
        prompts = make_prompts(args, llm.engine.executor.vocab_size)
        lengths = cycled(args.max_tokens, int, "max_tokens")
        temps = cycled(args.temperature, float, "temperature")
        seeds = cycled(args.request_seed, int, "request_seed") if args.request_seed else [None]
        schema = args.json_schema and StructuredOutputsParams(json=args.json_schema)
        params = [SamplingParams(max_tokens=lengths[i % len(lengths)], ignore_eos=True,
                                 temperature=temps[i % len(temps)], seed=seeds[i % len(seeds)],
                                 structured_outputs=schema or None)
                  for i in range(len(prompts))]
        probe = Probe(llm)
        outs = llm.generate(prompts, params, progress=False)
        seconds = time.perf_counter() - probe.start
    except ValueError as e:     # bad flags or a request that can never fit: say why
        sys.exit(f"workload: error: {e}")
    llm.engine.tracer.close()
    report(llm, probe, outs, seconds, args.show)


if __name__ == "__main__":
    main()
