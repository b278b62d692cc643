"""Exercise 1.3 (reference solution): the engine loop, written out.

`LLM.generate` is this loop plus tokenization and detokenization: add every request to the
engine core, then call `step()` until no request is left. Each step returns the tokens it
sampled; a request's new token is appended inside the scheduler (`Scheduler.update`), so the
next step feeds it back as input. That loop back is what makes generation autoregressive.
"""

from nanoserve.sampling_params import SamplingParams
from nanoserve.request import Request


def generate(core, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    ids = [f"loop-{i}" for i in range(len(prompts))]
    for request_id, prompt in zip(ids, prompts):
        core.add_request(Request(request_id, prompt, params))
    tokens: dict[str, list[int]] = {request_id: [] for request_id in ids}
    while core.has_unfinished_requests():
        for output in core.step():
            tokens[output.request_id] += output.new_token_ids
    return [tokens[request_id] for request_id in ids]
