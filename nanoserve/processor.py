"""processor.py: a prompt and its SamplingParams -> the engine's Requests (vLLM's
`vllm/v1/engine/processor.py`), for both front ends (engine.py's `LLM` and `AsyncLLM`).

Everything a request could never survive is refused here, before anything reaches the engine
core, as a ValueError naming the field (the server's HTTP 400): text too long to be worth
tokenizing (`max_prompt_chars`), token ids outside the vocabulary, a prompt + max_tokens that
could never fit (`check_fits`), logprobs past max_logprobs, a grammar that does not compile.
An n > 1 request becomes n child Requests with the same prompt:

    request "7", n = 2, seed 5  ->  Request("0_7", seed 5), Request("1_7", seed 6)

Lesson: lessons/01-the-map.md
"""

from __future__ import annotations

import dataclasses
from concurrent.futures import Future
from typing import Optional, Union

from nanoserve.config import Config
from nanoserve.request import Request, check_fits
from nanoserve.sampling_params import SamplingParams
from nanoserve.structured_output import compile_grammar, grammar_compiler, submit_compile

PromptType = Union[str, dict]


class Processor:
    """Prompt + SamplingParams -> engine Requests (tokenize, validate, fan out n > 1)."""

    def __init__(self, config: Config, tokenizer, vocab_size: int, model_path: str):
        self.config = config
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.tokenizer_source = config.tokenizer or str(model_path)
        gen_eos = _generation_config_eos(model_path)
        fallback_eos = (tokenizer.eos_token_id if tokenizer is not None
                        else _config_eos(model_path))   # skip_tokenizer_init: config.json's
        self.eos_token_id = gen_eos[0] if gen_eos else fallback_eos
        # Extra EOS ids (e.g. Llama 3's <|eot_id|>) stop generation unless ignore_eos.
        self.extra_eos_ids = [t for t in gen_eos if t != self.eos_token_id]
        # No token stands for more characters than the vocabulary's longest entry (added tokens
        # too; a byte-level entry has one character per byte), so a text longer than
        # max_model_len of them cannot fit: it is refused before the tokenizer spends seconds on it.
        self.max_prompt_chars = None if tokenizer is None else (
            config.max_model_len * max(map(len, tokenizer.get_vocab())))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """The text's token ids; ValueError naming `prompt` for a text too long to ever fit."""
        if self.tokenizer is None:
            raise ValueError("prompt must be {'prompt_token_ids': [...]} when "
                             "skip_tokenizer_init is set (no tokenizer to encode text)")
        if len(text) > self.max_prompt_chars:
            raise ValueError(f"prompt is {len(text)} characters, more than max_model_len "
                             f"({self.config.max_model_len}) tokens can hold "
                             f"({self.max_prompt_chars} characters at most)")
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def prompt_token_ids(self, prompt: PromptType) -> tuple[Optional[str], list[int]]:
        if isinstance(prompt, str):
            return prompt, self.encode(prompt)
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            ids = prompt["prompt_token_ids"]
            if not all(isinstance(t, int) and 0 <= t < self.vocab_size for t in ids):
                raise ValueError(f"prompt_token_ids must be integers in [0, {self.vocab_size})")
            return prompt.get("prompt"), list(ids)
        raise ValueError("prompt must be a string or {'prompt_token_ids': [...]} "
                         f"(got {type(prompt).__name__})")

    def make_requests(self, request_id: str, prompt_token_ids: list[int],
                      params: SamplingParams, priority: int = 0) -> list[Request]:
        """One Request per completion. Children of n > 1 get ids '{i}_{request_id}' and, when
        seeded, seeds seed + i, so they differ yet reproduce (as in vLLM). ValueError for a
        request that could never run: the same check for both front ends."""
        check_fits(self.config, len(prompt_token_ids), params.max_tokens)
        if params.logprobs is not None and params.logprobs > self.config.max_logprobs:
            raise ValueError(f"logprobs must be <= max_logprobs ({self.config.max_logprobs}) "
                             f"(got {params.logprobs})")
        if params.logprobs is not None and params.logprobs > self.vocab_size:
            raise ValueError(f"logprobs must be <= the vocabulary size {self.vocab_size} "
                             f"(got {params.logprobs})")
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer (skip_tokenizer_init is set); "
                             "use stop_token_ids")
        if any(t >= self.vocab_size for t in params.stop_token_ids):
            raise ValueError(f"stop_token_ids must be < the vocabulary size {self.vocab_size}")
        self.compile_grammar(params)
        if self.extra_eos_ids and not params.ignore_eos:
            params = dataclasses.replace(
                params, stop_token_ids=params.stop_token_ids + self.extra_eos_ids)
        if params.n == 1:
            return [Request(request_id, prompt_token_ids, params, self.eos_token_id,
                            priority=priority)]
        return [Request(f"{i}_{request_id}", prompt_token_ids,
                        dataclasses.replace(params, n=1, seed=None if params.seed is None
                                            else params.seed + i),
                        self.eos_token_id, priority=priority)
                for i in range(params.n)]

    def compile_grammar(self, params: SamplingParams, background: bool = False
                        ) -> Optional[Future]:
        """Compile the request's structured-output grammar, if it has one: a ValueError naming the
        field for one past a limit or invalid. Cached by the grammar's text. Here, or
        (`background`) on structured_output's thread pool, returning its Future: AsyncLLM
        compiles there first, so a new grammar never stalls the event loop."""
        if params.structured_outputs is None:
            return None
        if self.tokenizer is None:
            raise ValueError("structured_outputs needs a tokenizer (skip_tokenizer_init is set)")
        if background:
            return submit_compile(self.tokenizer_source, self.vocab_size, params.structured_outputs)
        compile_grammar(grammar_compiler(self.tokenizer_source, self.vocab_size),
                        params.structured_outputs)
        return None


def _config_eos(path) -> Optional[int]:
    from transformers import AutoConfig
    eos = getattr(AutoConfig.from_pretrained(path), "eos_token_id", None)
    return eos[0] if isinstance(eos, list) else eos


def _generation_config_eos(path) -> list[int]:
    from transformers import GenerationConfig
    try:
        eos = GenerationConfig.from_pretrained(path).eos_token_id
    except OSError:    # no generation_config.json: the tokenizer's EOS alone
        return []
    return [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
