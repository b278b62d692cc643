"""Wrong answer to exercise 1.3: steps max_tokens times, as if every request ran in every step
(true only while every request has a seat and a block)."""

from nanoserve.sampling_params import SamplingParams
from nanoserve.scheduler import Request


def generate(core, prompts, max_tokens):
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        core.add_request(Request(f"m{i}", prompt, params))
    tokens = {f"m{i}": [] for i in range(len(prompts))}
    for _ in range(max_tokens):
        for output in core.step():
            tokens[output.request_id] += output.new_token_ids
    return [tokens[f"m{i}"] for i in range(len(prompts))]
