"""structured_output.py: output a program can parse (a JSON schema, a regex, a choice, an EBNF
grammar), with xgrammar, placed where vLLM V1 places it:

    front end (Processor)   compile_grammar(): validate and compile (a bad schema, regex or
                            grammar is a ValueError naming the field: HTTP 400), in a thread off
                            the event loop; xgrammar's compiler caches by the grammar's text
    engine core             StructuredOutputManager: one GrammarMatcher per structured request
      every step            grammar_bitmask(): ONE bitmask for the step's structured rows
      sampler.py            apply_grammar_bitmask(): -inf where the bit is 0, before temperature
      after sampling        accept_tokens(): each matcher advances by its request's new token

A bitmask row covers the vocabulary, 32 tokens per int32 word: token t is allowed when bit t % 32
of word t // 32 is set. Vocabulary 40, a grammar that allows only tokens 1 and 33: the row is
[0b10, 0b10]. Once the grammar is complete the matcher allows only the request's stop tokens
(EOS, stop_token_ids), so the request ends with "stop" (scheduler.py's stop check).

The process boundary: the grammar's *text* crosses (it is in SamplingParams), not the compiled
grammar. A CompiledGrammar does not pickle; its `serialize_json` form is ~220 KB for a 20-field
schema of plain types (measured with a 1.5k and a 49k vocabulary) and deserializing it took 7 ms,
against 3 ms (1.5k) to 35 ms (49k) to compile. So the front end compiles to validate and to warm
its cache, and the engine core compiles its own cached copy from the same text, in a thread
that overlaps the request's prefill (xgrammar releases the GIL while it compiles); a grammar
sent again is a cache hit in either process (~0.2 ms with the first-token check). Where both
live in one process (`LLM`, --no-engine-process) they share one compiler, so one compile.

Known limit (xgrammar 0.2.9): a JSON string bounded by minLength/maxLength may hold raw control
characters (\x00-\x1f but \r \n), which strict JSON parsers refuse; `pattern` has no such gap.

Tests: pytest -x -q tests/test_structured_outputs.py
Lesson: lessons/07-sampling-and-config.md
"""

from __future__ import annotations

import functools
import json
import re
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Optional

from nanoserve.request import Request, SchedulerOutput
from nanoserve.sampling_params import StructuredOutputsParams

if TYPE_CHECKING:
    import torch
    import xgrammar

CACHE_LIMIT_BYTES = 512 * 2**20   # compiled grammars kept per process: vLLM's default cache size
# What each kind is, for the error message ("structured_outputs: the regex is not valid: ...").
_WHAT = {"json": "JSON schema", "regex": "regex", "choice": "list of choices",
         "grammar": "EBNF grammar", "json_object": "JSON object"}


@functools.lru_cache(maxsize=None)
def grammar_compiler(tokenizer_source: str, vocab_size: int) -> "xgrammar.GrammarCompiler":
    """This process's compiler for one tokenizer: the token table (every token's bytes) a
    grammar is compiled against, and the cache of compiled grammars. `vocab_size` is the
    model's (its LM head may be padded past the tokenizer's vocabulary): the bitmask's width."""
    import xgrammar
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_source)
    info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
    return xgrammar.GrammarCompiler(info, cache_enabled=True, cache_limit_bytes=CACHE_LIMIT_BYTES)


def compile_grammar(compiler: "xgrammar.GrammarCompiler",
                    params: StructuredOutputsParams) -> "xgrammar.CompiledGrammar":
    """The compiled grammar of `params`, or a ValueError naming the field for an invalid one.

        choice ["yes", "no"]  ->  EBNF  root ::= "yes" | "no"
    """
    kind = params.kind
    try:
        compiled = _compile(compiler, params)
    except (RuntimeError, RecursionError) as e:  # xgrammar's: "[time] file.cc:line: what"
        why = re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", str(e).strip()).splitlines()[0]
        raise ValueError(f"structured_outputs: the {_WHAT[kind]} is not valid: {why}") from None
    if _first_bitmask(compiled).ne(0).any():
        return compiled
    raise ValueError(f"structured_outputs: the {_WHAT[kind]} matches no text (no first token fits)")


def _compile(compiler, params: StructuredOutputsParams) -> "xgrammar.CompiledGrammar":
    kind, text = params.kind, params.text
    if kind in ("json", "json_object"):
        # Compact JSON (vLLM's disable_any_whitespace): with free whitespace a weak model fills
        # its tokens with it (the built-in model wrote 100 tokens of newlines and no JSON).
        return compiler.compile_json_schema(text if kind == "json" else '{"type": "object"}',
                                            any_whitespace=False)
    if kind == "regex":
        return compiler.compile_regex(text)
    if kind == "choice":     # JSON string literals are EBNF string literals (escapes included)
        choices = " | ".join(json.dumps(c, ensure_ascii=False) for c in params.choice)
        return compiler.compile_grammar(f"root ::= {choices}")   # (\u surrogates would not match)
    return compiler.compile_grammar(text)


def _first_bitmask(compiled: "xgrammar.CompiledGrammar") -> "torch.Tensor":
    import xgrammar
    bitmask = xgrammar.allocate_token_bitmask(1, compiled.tokenizer_info.vocab_size)
    xgrammar.GrammarMatcher(compiled).fill_next_token_bitmask(bitmask)
    return bitmask


class StructuredOutputManager:
    """The engine core's side: each structured request's matcher, the step's bitmask, and the
    matchers' advance. A step without a structured request does no work here (one dict check)."""

    def __init__(self, tokenizer_source: str, vocab_size: int):
        self.tokenizer_source, self.vocab_size = tokenizer_source, vocab_size
        self.matchers: dict[str, "xgrammar.GrammarMatcher"] = {}    # request id -> its matcher
        self._compiling: dict[str, Future] = {}   # request id -> its matcher, still compiling
        self._executor: Optional[ThreadPoolExecutor] = None
        self._batch = None                        # xgrammar's batch filler, made when needed

    def add_request(self, request: Request) -> None:
        """Start compiling the request's grammar (a cache hit when the text was seen before)."""
        params = request.sampling_params
        if params.structured_outputs is None:
            return
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="nanoserve-grammar")
        stop_ids = sorted({request.eos_token_id, *params.stop_token_ids} - {None})
        self._compiling[request.request_id] = self._executor.submit(
            self._new_matcher, params.structured_outputs, stop_ids)

    def _new_matcher(self, params: StructuredOutputsParams,
                     stop_ids: list[int]) -> "xgrammar.GrammarMatcher":
        import xgrammar
        compiled = compile_grammar(grammar_compiler(self.tokenizer_source, self.vocab_size), params)
        # The request's own stop tokens end the grammar (the tokenizer's EOS may not be the model's).
        return xgrammar.GrammarMatcher(compiled, override_stop_tokens=stop_ids or None)

    def remove(self, request_ids) -> None:
        """Drop the matchers of finished and aborted requests (a preempted one keeps its matcher:
        its output tokens stay, so the matcher's state is still the request's)."""
        for request_id in request_ids:
            self.matchers.pop(request_id, None)
            if (future := self._compiling.pop(request_id, None)) is not None:
                future.cancel()

    def grammar_bitmask(self, out: SchedulerOutput) -> Optional[tuple["torch.Tensor", list[str]]]:
        """(bitmask [rows, ceil(vocab / 32)] int32 on the CPU, the request id of each row) for
        the step's structured requests that sample (a prefill chunk that stops short of its
        prompt's end samples nothing, as in model_runner.py); None when there are none."""
        if not self.matchers and not self._compiling:
            return None
        ids = [r.request_id for r, n, c in zip(out.requests, out.num_scheduled_tokens,
                                               out.num_computed_tokens)
               if c + n == r.num_tokens and r.sampling_params.structured_outputs is not None]
        if not ids:
            return None
        import xgrammar
        for request_id in ids:     # a grammar still compiling is waited for here, at its first use
            if request_id in self._compiling:
                self.matchers[request_id] = self._compiling.pop(request_id).result()
        bitmask = xgrammar.allocate_token_bitmask(len(ids), self.vocab_size)
        self._batch = self._batch or xgrammar.BatchGrammarMatcher()
        self._batch.batch_fill_next_token_bitmask([self.matchers[i] for i in ids], bitmask)
        for row in bitmask.ne(0).any(dim=1).logical_not().nonzero().flatten().tolist():
            # A grammar can corner itself (`root ::= "a" x  x ::= x`: after "a" no token fits).
            # Its request gets a grammar that only stops, so it ends instead of sampling from
            # nothing (an all -inf row) and failing the whole step.
            self.matchers[ids[row]] = self._stop_only(self.matchers[ids[row]].stop_token_ids)
            self.matchers[ids[row]].fill_next_token_bitmask(bitmask, row)
        return bitmask, ids

    def _stop_only(self, stop_ids: list[int]) -> "xgrammar.GrammarMatcher":
        import xgrammar
        compiler = grammar_compiler(self.tokenizer_source, self.vocab_size)
        return xgrammar.GrammarMatcher(compiler.compile_grammar('root ::= ""'),
                                       override_stop_tokens=stop_ids)

    def accept_tokens(self, sampled: dict[str, int]) -> list[str]:
        """Advance each structured request's matcher by the token it sampled; returns the
        requests whose grammar refused it (its bitmask allowed it: a bug), which fail alone."""
        refused = []
        if not self.matchers:
            return refused
        for request_id, token in sampled.items():
            matcher = self.matchers.get(request_id)
            if matcher is not None and not matcher.accept_token(token):
                refused.append(request_id)
        return refused
