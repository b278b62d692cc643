"""checks_clinic.py: exercise 10.4's check. The clinic's prescriptions are judged by their effect,
never by their wording: the check runs each patient's setup as it was (to check the evidence the
learner read off it) and with the learner's flags (to check that the symptom is gone), on the
built-in model, with the lesson's workloads (lessons/workload.py's prompts, EOS ignored, so the
schedules are the lesson's, step for step).
"""

from __future__ import annotations

import gc
import random
import tempfile
from dataclasses import fields
from pathlib import Path

from check_kit import expect, own_work

# Each patient's flags as they came in (lessons/10-clinic.md), and the workload of B and C:
# (requests, prompt tokens, output tokens).
FLAWED = {"A": {"kv_cache_memory_gb": 0.0005}, "B": {"max_num_batched_tokens": 16},
          "C": {"kv_cache_memory_gb": 0.002}}
WORKLOAD = {"B": (8, 256, 16), "C": (16, 64, 64)}
CONTEXT = 512       # what patient A needs: sequences of 512 tokens (the model's longest)


def run(flags: dict, workload: tuple[int, int, int]):
    """Run the workload with these flags, traced; from the trace (nanoserve/trace.py): (steps,
    preemptions, the step at which the last request sampled its first token)."""
    from nanoserve import LLM, SamplingParams
    from nanoserve.trace import Trace
    n, prompt_len, max_tokens = workload
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "run.jsonl"
        llm = LLM(**flags, trace=str(path))
        vocab = llm.engine.executor.vocab_size
        prompts = [{"prompt_token_ids": random.Random(i).choices(range(1, vocab), k=prompt_len)}
                   for i in range(n)]
        llm.generate(prompts, SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                     progress=False)
        llm.engine.tracer.close()
        del llm
        gc.collect()        # each engine holds its KV pool (1 GiB by default on a CPU)
        trace = Trace.load(str(path))
    steps = sum(1 for f in trace.frames.values() if f.schedule.get("scheduled"))
    preemptions = sum(len(r.preempt_steps) for r in trace.requests.values())
    last_first_token = max(r.token_steps[0] for r in trace.requests.values())
    return steps, preemptions, last_first_token


def prescription(mod, mystery: str) -> dict:
    """The patient's flags with the learner's changes over them."""
    from nanoserve import Config
    flags = ask(mod, "prescribe", mystery)
    names = {f.name for f in fields(Config)}
    expect(isinstance(flags, dict) and flags, f"prescribe({mystery!r}) must return the flags to "
           f"change, as {{config field: new value}} (got {flags!r})")
    unknown = sorted(set(flags) - names)
    expect(not unknown, f"prescribe({mystery!r}): {', '.join(unknown)} is no Config field (write "
           "max_num_batched_tokens, not --max-num-batched-tokens)")
    return {**FLAWED[mystery], **flags}


def ask(mod, name: str, mystery: str):
    """The learner's answer `name`(mystery), their own: neither the reference solution's nor
    this check's runs (run, memory_report) may give it."""
    from nanoserve.tools.memory import memory_report
    with own_work(mod, ["evidence", "prescribe"], [run, memory_report],
                  "read the evidence off the lesson's runs, and prescribe, yourself"):
        return getattr(mod, name)(mystery)


def check_clinic(mod, say) -> None:
    import torch
    threads = torch.get_num_threads()
    torch.set_num_threads(1)    # as the lessons' commands run: a 2M-parameter model loses nothing
    try:
        diagnose(mod, say)
    finally:
        torch.set_num_threads(threads)


def diagnose(mod, say) -> None:
    from nanoserve import LLM, SamplingParams
    from nanoserve.tools.memory import memory_report
    # A: refuses to start. The evidence: the pool's size in tokens, as the refusal states it.
    pool = memory_report(**FLAWED["A"])
    tokens = pool.num_blocks * pool.block_size
    flags = prescription(mod, "A")
    answer = ask(mod, "evidence", "A")
    expect(answer == tokens, f"A: evidence('A') = {answer}: the refusal says "
           f"how many tokens the KV cache holds; read it again")
    try:
        llm = LLM(**flags)
    except ValueError as e:
        raise AssertionError(f"A: with {flags} the server still refuses to start: {e}") from None
    expect(llm.config.max_model_len >= CONTEXT, f"A: max_model_len {llm.config.max_model_len}: "
           f"the patient needs sequences of {CONTEXT} tokens; fix the memory, not their context")
    out = llm.generate([{"prompt_token_ids": [1] * (CONTEXT - 16)}],
                       SamplingParams(max_tokens=16, ignore_eos=True), progress=False)
    expect(len(out[0].outputs[0].token_ids) == 16, "A: a request of 512 tokens did not finish")
    del llm
    gc.collect()
    say(f"A: the pool held {tokens} tokens; with {flags} the server starts and serves a sequence "
        f"of {CONTEXT} tokens")
    # B: a slow first token. The evidence: the step at which the last request got its first token.
    _, _, slow = run(FLAWED["B"], WORKLOAD["B"])
    flags = prescription(mod, "B")
    answer = ask(mod, "evidence", "B")
    expect(answer == slow, f"B: evidence('B') = {answer}: read again, in "
           "the trace, the step at which the last request samples its first token")
    _, _, fixed = run(flags, WORKLOAD["B"])
    _, _, default = run({}, WORKLOAD["B"])
    expect(fixed <= default, f"B: with {flags} the last first token still comes at step {fixed} "
           f"(step {slow} as it came in, step {default} with the default flags): the prompts "
           "still go through in small pieces")
    say(f"B: the last first token at step {slow} as it came in, at step {fixed} with {flags}")
    # C: a preemption storm. The evidence: how many preemptions the run had.
    storm_steps, storm, _ = run(FLAWED["C"], WORKLOAD["C"])
    flags = prescription(mod, "C")
    answer = ask(mod, "evidence", "C")
    expect(answer == storm, f"C: evidence('C') = {answer}: count the "
           "preemptions again (the workload's report, the trace or /metrics' num_preemptions_total)")
    steps, preempted, _ = run(flags, WORKLOAD["C"])
    expect(preempted == 0, f"C: with {flags} the run still preempts {preempted} times")
    expect(steps <= storm_steps, f"C: with {flags} no preemption, but {steps} steps against the "
           f"storm's {storm_steps}: the preemptions went, and the parallelism with them; the "
           "patient's complaint was speed")
    say(f"C: {storm} preemptions in {storm_steps} steps as it came in; with {flags} none, in "
        f"{steps} steps")
