"""Exercise 1.3: the engine loop, by hand (lesson 01-the-map.md).

Goal: `generate(core, prompts, max_tokens)` returns what `LLM.generate` would for the same
token-id prompts (greedy, exactly `max_tokens` tokens each, EOS ignored), driving the engine
core yourself: one list of output token ids per prompt, in the order of `prompts`. When it
returns, the engine must be idle, every block free. The check runs it with two seats for
three prompts in a pool so small that requests get preempted, with blocks of 4 and of 16
tokens; every core.step() must come from your own loop (LLM.generate may not run).

The engine core's interface (nanoserve/engine_core.py, EngineCore):
    core.add_request(Request(request_id, prompt_token_ids, sampling_params))
    core.step() -> list of EngineCoreOutput     (.request_id, .new_token_ids, .finish_reason)
    core.has_unfinished_requests() -> bool

Read first: nanoserve/engine_core.py (EngineCore.step), nanoserve/request.py (Request).
Check: `nanoserve exercise check 1.3`.
"""

from nanoserve.sampling_params import SamplingParams  # noqa: F401  (you will need these)
from nanoserve.request import Request  # noqa: F401


def generate(core, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Greedy outputs of `prompts` (token ids), run on the EngineCore `core`."""
    raise NotImplementedError(
        "implement generate(core, prompts, max_tokens) in "
        "lessons/exercises/lesson1_engine_loop.py: each prompt's greedy output, as "
        "LLM.generate gives it, computed by driving the engine core yourself")
