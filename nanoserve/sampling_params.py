"""sampling_params.py: what one request asks of the sampler and of the stop checks.

The names and defaults follow vLLM's `SamplingParams`, so a vLLM user's code reads the same:

    >>> SamplingParams(temperature=0.0, max_tokens=8).is_greedy
    True
    >>> SamplingParams(top_p=1.5)
    Traceback (most recent call last):
    ...
    ValueError: top_p must be in (0, 1] (got 1.5)

`structured_outputs` (vLLM's `StructuredOutputsParams`) constrains the output to a JSON schema, a
regex, a choice or an EBNF grammar (structured_output.py):

    >>> StructuredOutputsParams(choice=["yes", "no"]).kind
    'choice'
    >>> StructuredOutputsParams(choice=["yes"], regex="y")
    Traceback (most recent call last):
    ...
    ValueError: structured_outputs must set exactly one of json, regex, choice, grammar, json_object (got ['regex', 'choice'])

Validation happens here, at construction, so bad input is refused before it reaches the
engine: every number is finite and fits the type the step computes it in (an int is an int64,
a float a float32), so no value that passed can make a step, or the socket to it, raise. A
temperature in (0, 0.01) is raised to 0.01, as vLLM does (dividing by less overflows the
float32 logits), and a repetition penalty, which divides them too, must be >= 0.01. The checks that need the
model (stop_token_ids against the vocabulary, logprobs against max_logprobs) are
Processor's (processor.py). The sampler re-checks none of it, only asserts. Torch-free: the
scheduler and the API server read it too.
"""

from __future__ import annotations

import json as json_module
import logging
from dataclasses import dataclass
from typing import Optional, Union

STRUCTURED_OUTPUT_KINDS = ("json", "regex", "choice", "grammar", "json_object")
# vLLM's floor (vllm/sampling_params.py, _MAX_TEMP): 0 < temperature < it is raised to it, with a
# warning, since logits / 1e-300 are inf in float32 and the row's probabilities NaN.
_MAX_TEMP = 1e-2
FLOAT32_MAX = 3.4028234663852886e38   # the sampler's floats: a larger |value| is inf there
INT64_MIN, INT64_MAX = -2**63, 2**63 - 1   # every int's range: a seed's (torch.Generator; vLLM's
                                          # protocol too), and msgpack's on the wire
_FLOAT_FIELDS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                 "repetition_penalty")


@dataclass
class StructuredOutputsParams:
    """What the output must match: exactly one of `json` (a JSON schema, as a dict or its text),
    `regex` (matched whole), `choice` (one of these strings), `grammar` (EBNF, in xgrammar's
    dialect: `root ::= ...`) or `json_object` (any JSON object). vLLM's names; whether a schema,
    regex or grammar is valid is the compiler's to say (structured_output.py:compile_grammar)."""

    json: Optional[Union[str, dict]] = None
    regex: Optional[str] = None
    choice: Optional[list[str]] = None
    grammar: Optional[str] = None
    json_object: Optional[bool] = None

    def __post_init__(self):
        kinds = [k for k in STRUCTURED_OUTPUT_KINDS if getattr(self, k) not in (None, False)]
        _check(len(kinds) == 1, "structured_outputs",
               f"must set exactly one of {', '.join(STRUCTURED_OUTPUT_KINDS)}", kinds)
        _check(self.json is None or isinstance(self.json, (str, dict)), "structured_outputs",
               "json must be a JSON schema (an object or its text)", self.json)
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            _check(value is None or (isinstance(value, str) and value), "structured_outputs",
                   f"{name} must be a non-empty string", value)
        _check(self.choice is None or (isinstance(self.choice, list) and self.choice and
                                       all(isinstance(c, str) for c in self.choice)),
               "structured_outputs", "choice must be a non-empty list of strings", self.choice)
        _check(self.json_object in (None, True, False), "structured_outputs",
               "json_object must be a boolean", self.json_object)

    @property
    def kind(self) -> str:
        return next(k for k in STRUCTURED_OUTPUT_KINDS if getattr(self, k) not in (None, False))

    @property
    def text(self) -> str:
        """The constraint as text (a schema dict as JSON, choices as a JSON list): with `kind`,
        what the compilers cache by and what crosses to the engine core."""
        value = getattr(self, self.kind)
        return value if isinstance(value, str) else json_module.dumps(value, ensure_ascii=False)


@dataclass
class SamplingParams:
    n: int = 1                       # completions per prompt (they share the prompt's blocks)
    temperature: float = 1.0         # 0 = greedy
    top_p: float = 1.0               # nucleus: keep the smallest set with mass >= top_p
    top_k: int = 0                   # keep the k most likely tokens; 0 (or -1) = all
    min_p: float = 0.0               # drop tokens whose prob < min_p * max prob
    seed: Optional[int] = None       # a request's own generator: same seed, same tokens
    max_tokens: Optional[int] = 16   # None = until max_model_len
    min_tokens: int = 0              # EOS and stop_token_ids are masked until this many
    stop: Optional[Union[str, list[str]]] = None    # stop strings, checked on text
    stop_token_ids: Optional[list[int]] = None
    ignore_eos: bool = False
    presence_penalty: float = 0.0    # -2..2, once per token that has appeared in the output
    frequency_penalty: float = 0.0   # -2..2, per occurrence in the output
    repetition_penalty: float = 1.0  # >= 0.01; > 1 discourages tokens of prompt and output
    logprobs: Optional[int] = None   # also return the top-n logprobs of each sampled token
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    structured_outputs: Optional[StructuredOutputsParams] = None   # JSON schema, regex, ...

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        _check(is_int(self.n) and self.n >= 1, "n", "must be an integer >= 1", self.n)
        for name in _FLOAT_FIELDS:     # NaN and +-inf fail the comparison too
            value = getattr(self, name)
            _check(is_num(value) and -FLOAT32_MAX <= value <= FLOAT32_MAX, name,
                   "must be a finite number (within float32's range)", value)
            setattr(self, name, float(value))   # an int as big as 2**64 crosses no socket
        for name in ("n", "top_k", "max_tokens", "min_tokens", "logprobs"):   # nor here
            value = getattr(self, name)
            _check(not is_int(value) or INT64_MIN <= value <= INT64_MAX, name,
                   "must be within int64", value)
        _check(self.temperature >= 0, "temperature", "must be >= 0", self.temperature)
        if 0 < self.temperature < _MAX_TEMP:
            logging.getLogger("nanoserve").warning(
                "temperature %s is below %s, which makes the logits inf or NaN; raised to %s "
                "(as vLLM does)", self.temperature, _MAX_TEMP, _MAX_TEMP)
            self.temperature = _MAX_TEMP
        _check(0 < self.top_p <= 1, "top_p", "must be in (0, 1]", self.top_p)
        _check(is_int(self.top_k) and self.top_k >= 0, "top_k",
               "must be an integer >= 0 (0 or -1 disables it)", self.top_k)
        _check(0 <= self.min_p <= 1, "min_p", "must be in [0, 1]", self.min_p)
        _check(self.seed is None or (is_int(self.seed) and INT64_MIN <= self.seed <= INT64_MAX),
               "seed", "must be an integer in [-2**63, 2**63 - 1] (an int64)", self.seed)
        _check(self.max_tokens is None or (is_int(self.max_tokens) and self.max_tokens >= 1),
               "max_tokens", "must be an integer >= 1", self.max_tokens)
        _check(is_int(self.min_tokens) and self.min_tokens >= 0, "min_tokens",
               "must be an integer >= 0", self.min_tokens)
        _check(self.max_tokens is None or self.min_tokens <= self.max_tokens, "min_tokens",
               f"must be <= max_tokens ({self.max_tokens})", self.min_tokens)
        _check(all(isinstance(s, str) and s for s in self.stop), "stop",
               "must be non-empty strings", self.stop)
        _check(all(is_int(t) and 0 <= t <= INT64_MAX for t in self.stop_token_ids),
               "stop_token_ids", "must be token ids (integers >= 0)", self.stop_token_ids)
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(-2 <= value <= 2, name, "must be in [-2, 2]", value)
        # It divides the positive logits, as a temperature does: below vLLM's temperature floor
        # they overflow float32 (vLLM itself takes any value > 0).
        _check(self.repetition_penalty >= _MAX_TEMP, "repetition_penalty",
               f"must be >= {_MAX_TEMP}", self.repetition_penalty)
        _check(self.logprobs is None or (is_int(self.logprobs) and self.logprobs >= 0),
               "logprobs", "must be an integer >= 0", self.logprobs)
        _check(self.structured_outputs is None or isinstance(self.structured_outputs,
                                                             StructuredOutputsParams),
               "structured_outputs", "must be a StructuredOutputsParams", self.structured_outputs)
        # A grammar allows its stop tokens only once it is complete; min_tokens would then mask
        # the only tokens left (and the grammar decides where the output ends anyway).
        _check(self.structured_outputs is None or self.min_tokens == 0, "min_tokens",
               "must be 0 with structured_outputs (the grammar decides where the output ends)",
               self.min_tokens)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0


def is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def is_num(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _check(ok: bool, name: str, rule: str, value) -> None:
    if not ok:
        raise ValueError(f"{name} {rule} (got {value!r:.100})")   # 100 characters of it at most
