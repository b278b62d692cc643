"""Exercise 1.3: the engine loop, by hand (lesson 01-the-map.md).

`LLM.generate` hides a loop. Write it yourself against the engine core:

1. make one `Request(request_id, prompt_token_ids, params)` per prompt, with
   `SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)`, and hand each
   to `core.add_request(...)`;
2. call `core.step()` until `core.has_unfinished_requests()` is False; every step returns a
   list of `EngineCoreOutput`s, each with `request_id` and `new_token_ids`;
3. return each prompt's output token ids, in the order of `prompts`.

Read first: nanoserve/engine_core.py (EngineCore.step), nanoserve/engine.py (LLM.generate),
nanoserve/request.py (Request), nanoserve/scheduler.py (Scheduler.update). Check:
`nanoserve exercise check 1.3`.
"""

from nanoserve.sampling_params import SamplingParams  # noqa: F401  (you will need these)
from nanoserve.request import Request  # noqa: F401


def generate(core, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Greedy outputs of `prompts` (token ids), run on the EngineCore `core`."""
    raise NotImplementedError(
        "implement generate(core, prompts, max_tokens) in "
        "lessons/exercises/lesson1_engine_loop.py: add one Request per prompt, call "
        "core.step() until no request is left, collect each request's new_token_ids")
