"""structured_output.py: output a program can parse (a JSON schema, a regex, a choice, an EBNF
grammar), with xgrammar, placed where vLLM V1 places it:

    front end (Processor)   check_limits() first (size, enum values, nesting), then
                            compile_grammar(): validate and compile (a bad schema, regex or
                            grammar is a ValueError naming the field: HTTP 400); AsyncLLM's
                            through submit_compile(), on a small thread pool, waited for at
                            most COMPILE_TIMEOUT_S; xgrammar caches by the text
    engine core             StructuredOutputManager: one GrammarMatcher per structured request;
                            the request waits as WAITING_FOR_FSM until its grammar is compiled
      every step            update_fsm(): compiled ones go on to WAITING, failed ones fail
                            grammar_bitmask(): ONE bitmask for the step's structured rows
      sampler.py            apply_grammar_bitmask(): -inf where the bit is 0, before temperature
      after sampling        accept_tokens(): each matcher advances by its request's new token

A bitmask row covers the vocabulary, 32 tokens per int32 word: token t is allowed when bit t % 32
of word t // 32 is set. Vocabulary 40, a grammar that allows only tokens 1 and 33: the row is
[0b10, 0b10]. Once the grammar is complete the matcher allows only the request's stop tokens
(EOS, stop_token_ids), so the request ends with "stop" (scheduler.py's stop check).

Nothing waits for a compile on the step loop. A compile takes from 0.2 ms (a cache hit) to
seconds: a 50,000-value `enum` (0.49 MB) took 30 s on 2 Xeon cores, its cost growing faster
than its size. So the limits below refuse such a grammar before it compiles, the compile runs
on COMPILE_THREADS threads (xgrammar releases the GIL), and the engine core schedules the
others while a request's grammar compiles (vLLM's WAITING_FOR_FSM). A compile that outlives
COMPILE_TIMEOUT_S fails its request alone; it cannot be stopped, so it finishes in the
background, and a request with the same text waits for it instead of starting another.

The process boundary: the grammar's *text* crosses (it is in SamplingParams), not the compiled
grammar. A CompiledGrammar does not pickle; its `serialize_json` form is ~220 KB for a 20-field
schema of plain types (measured with a 1.5k and a 49k vocabulary) and deserializing it took 7 ms,
against 3 ms (1.5k) to 35 ms (49k) to compile. So the front end compiles to validate and to warm
its cache, and the engine core compiles its own cached copy from the same text; a grammar sent
again is a cache hit in either process (~0.2 ms with the first-token check). Where both live in
one process (`LLM`, --no-engine-process) they share one compiler, so one compile.

Known limit (xgrammar 0.2.9): a JSON string bounded by minLength/maxLength may hold raw control
characters (\x00-\x1f but \r \n), which strict JSON parsers refuse; `pattern` has no such gap.

Tests: pytest -x -q tests/test_structured_outputs.py tests/test_security_grammar.py
Lesson: lessons/07-sampling-and-config.md
"""

from __future__ import annotations

import functools
import json
import re
import threading
import time
from concurrent import futures
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Optional

from nanoserve.request import Request, SchedulerOutput
from nanoserve.sampling_params import StructuredOutputsParams

if TYPE_CHECKING:
    import torch
    import xgrammar

CACHE_LIMIT_BYTES = 512 * 2**20   # compiled grammars kept per process: vLLM's default cache size
# The limits, checked before anything compiles. Measured on 2 Xeon cores with the built-in model:
# a compile's cost grows faster than its text (enum strings: 16 KB 0.08 s, 32 KB 0.18 s, 64 KB
# 0.5 s, 124 KB 1.8 s, 0.49 MB 30 s; on a busy machine 32 KB took up to 0.56 s and 64 KB up to
# 2.2 s, however the text was cut: one long string, or 1000 short ones), so its size bounds it;
MAX_GRAMMAR_BYTES = 32 * 2**10
# ... nesting too (arrays in arrays: 32 deep 0.01 s, 128 deep 0.4 s, 1000 deep (25 KB) 53 s);
# a schema's document depth, objects and arrays: an object property is two ({properties: {x: }})
MAX_SCHEMA_DEPTH = 32
# ... and OpenAI's structured outputs take 1000 enum values in all: enum values, consts, choices
MAX_ENUM_VALUES = 1000
# A compile past this fails its request (400 up front, or an error from the engine core): with
# the limits above the slowest we found took 0.6 s, so only a pathological grammar reaches it.
COMPILE_TIMEOUT_S = 10.0
COMPILE_THREADS = 2    # per process: a flood of compiles queues, and one slow one holds no other
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


def check_limits(params: StructuredOutputsParams) -> None:
    """A ValueError naming the field for a grammar past a limit (MAX_SCHEMA_DEPTH,
    MAX_GRAMMAR_BYTES, MAX_ENUM_VALUES): cheap, so it runs before anything compiles."""
    what, schema = _WHAT[params.kind], params.json
    too_deep = ValueError(f"structured_outputs: the {what} nests more than {MAX_SCHEMA_DEPTH} "
                          "levels deep")
    if isinstance(schema, str) and len(schema.encode()) <= MAX_GRAMMAR_BYTES:
        try:
            schema = json.loads(schema)
        except RecursionError:      # json's own limit, far past ours
            raise too_deep from None
        except ValueError:          # not JSON: the compiler says why
            schema = None
    depth, values = (_schema_shape(schema) if params.kind == "json"
                     else (0, len(params.choice or ())))
    if depth > MAX_SCHEMA_DEPTH:
        raise too_deep
    if (size := len(params.text.encode())) > MAX_GRAMMAR_BYTES:
        raise ValueError(f"structured_outputs: the {what} is {size} bytes, more than the limit "
                         f"of {MAX_GRAMMAR_BYTES}")
    if values > MAX_ENUM_VALUES:
        raise ValueError(f"structured_outputs: the {what} has {values} enum values or choices, "
                         f"more than the limit of {MAX_ENUM_VALUES}")


def _schema_shape(schema) -> tuple[int, int]:
    """(nesting depth of objects and arrays, enum values + consts) of a JSON schema document,
    walked without recursion: {"enum": ["a", "b"]} -> (2, 2)."""
    depth, values, stack = 0, 0, [(schema, 1)]
    while stack:
        node, level = stack.pop()
        if isinstance(node, dict):
            enum = node.get("enum")
            values += (len(enum) if isinstance(enum, list) else 0) + ("const" in node)
            node = node.values()
        elif not isinstance(node, list):
            continue
        depth = max(depth, level)
        stack += [(child, level + 1) for child in node]
    return depth, values


def compile_grammar(compiler: "xgrammar.GrammarCompiler",
                    params: StructuredOutputsParams) -> "xgrammar.CompiledGrammar":
    """The compiled grammar of `params`, or a ValueError naming the field for one past a limit or
    an invalid one (in the calling thread: the offline LLM's; AsyncLLM's is submit_compile).

        choice ["yes", "no"]  ->  EBNF  root ::= "yes" | "no"
    """
    check_limits(params)
    return _compile_valid(compiler, params)


def _compile_valid(compiler, params: StructuredOutputsParams) -> "xgrammar.CompiledGrammar":
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


_in_flight: dict[tuple, Future] = {}    # (tokenizer, vocab size, kind, text) -> its compile
_in_flight_lock = threading.Lock()


@functools.lru_cache(maxsize=None)
def _compile_pool() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(COMPILE_THREADS, thread_name_prefix="nanoserve-grammar")


def submit_compile(tokenizer_source: str, vocab_size: int,
                   params: StructuredOutputsParams) -> Future:
    """compile_grammar on the pool: a Future of the CompiledGrammar or of its ValueError. The
    limits are checked here, at once: past one, the Future has failed already and nothing
    compiles. A text still compiling (one that timed out too) is not compiled twice: its
    Future is shared."""
    try:
        check_limits(params)
    except ValueError as e:
        future = Future()
        future.set_exception(e)
        return future
    key = (tokenizer_source, vocab_size, params.kind, params.text)
    with _in_flight_lock:
        if (future := _in_flight.get(key)) is None:
            future = _in_flight[key] = _compile_pool().submit(_compile_once, key, params)
    return future


def _compile_once(key: tuple, params: StructuredOutputsParams) -> "xgrammar.CompiledGrammar":
    try:
        return _compile_valid(grammar_compiler(*key[:2]), params)
    finally:
        with _in_flight_lock:
            del _in_flight[key]


def timed_out(params: StructuredOutputsParams) -> ValueError:
    return ValueError(f"structured_outputs: the {_WHAT[params.kind]} took longer than "
                      f"{COMPILE_TIMEOUT_S:g} s to compile")


class StructuredOutputManager:
    """The engine core's side: each structured request's compile and matcher, the step's bitmask,
    and the matchers' advance. A step without a structured request does no work here (a dict
    check or two)."""

    def __init__(self, tokenizer_source: str, vocab_size: int):
        self.tokenizer_source, self.vocab_size = tokenizer_source, vocab_size
        self.matchers: dict[str, "xgrammar.GrammarMatcher"] = {}    # request id -> its matcher
        # request id -> (the request, its compile, when it times out): WAITING_FOR_FSM requests
        self.compiling: dict[str, tuple[Request, Future, float]] = {}
        self._batch = None                        # xgrammar's batch filler, made when needed

    def add_request(self, request: Request) -> bool:
        """Start compiling the request's grammar (a cache hit when the text was seen before);
        whether it has one, so that it waits for it (WAITING_FOR_FSM)."""
        params = request.sampling_params.structured_outputs
        if params is None:
            return False
        future = submit_compile(self.tokenizer_source, self.vocab_size, params)
        self.compiling[request.request_id] = (request, future, time.monotonic() + COMPILE_TIMEOUT_S)
        return True

    def update_fsm(self, wait: bool = False) -> tuple[list[str], dict[str, Exception]]:
        """(the requests whose grammar has compiled since the last call, each now with its
        matcher; {request id: its error} for those whose compile failed or ran past
        COMPILE_TIMEOUT_S). `wait`: nothing else can run, so wait up to 10 ms for a compile
        (the loop still takes new requests that often) instead of spinning."""
        if wait and self.compiling:
            futures.wait([f for _, f, _ in self.compiling.values()], timeout=0.01,
                         return_when=futures.FIRST_COMPLETED)
        import xgrammar
        ready, failed, now = [], {}, time.monotonic()
        for request_id, (request, future, deadline) in list(self.compiling.items()):
            if future.done() and future.exception() is None:
                # The request's own stop tokens end the grammar (the tokenizer's EOS may not be
                # the model's).
                stop_ids = sorted({request.eos_token_id,
                                   *request.sampling_params.stop_token_ids} - {None})
                self.matchers[request_id] = xgrammar.GrammarMatcher(
                    future.result(), override_stop_tokens=stop_ids or None)
                ready.append(request_id)
            elif future.done() or now > deadline:
                failed[request_id] = (future.exception() if future.done() else
                                      timed_out(request.sampling_params.structured_outputs))
            else:
                continue
            del self.compiling[request_id]
        return ready, failed

    def remove(self, request_ids) -> None:
        """Drop the matchers of finished and aborted requests (a preempted one keeps its matcher:
        its output tokens stay, so the matcher's state is still the request's). A compile goes
        on (another request may share it); nobody waits for it."""
        for request_id in request_ids:
            self.matchers.pop(request_id, None)
            self.compiling.pop(request_id, None)

    def grammar_bitmask(self, out: SchedulerOutput) -> Optional[tuple["torch.Tensor", list[str]]]:
        """(bitmask [rows, ceil(vocab / 32)] int32 on the CPU, the request id of each row) for
        the step's structured requests that sample (a prefill chunk that stops short of its
        prompt's end samples nothing, as in model_runner.py); None when there are none. Every
        scheduled structured request has its matcher: the scheduler admits none before."""
        if not self.matchers:
            return None
        ids = [r.request_id for r, n, c in zip(out.requests, out.num_scheduled_tokens,
                                               out.num_computed_tokens)
               if c + n == r.num_tokens and r.sampling_params.structured_outputs is not None]
        if not ids:
            return None
        import xgrammar
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

    def accept_tokens(self, sampled: dict[str, list[int]]) -> list[str]:
        """Advance each structured request's matcher by the tokens it sampled (one: it has no
        drafts); returns the requests whose grammar refused one (its bitmask allowed it: a bug),
        which fail alone."""
        refused = []
        if not self.matchers:
            return refused
        for request_id, tokens in sampled.items():
            matcher = self.matchers.get(request_id)
            if matcher is not None and not all(matcher.accept_token(t) for t in tokens):
                refused.append(request_id)
        return refused
