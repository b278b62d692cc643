"""output_processor.py: from the engine's token ids to what a user reads (the front end's half).

The engine core works in token ids only. This module, shared by the offline `LLM` and the
HTTP server's `AsyncLLM` (vLLM keeps it in the front-end process for the same reason: it is
CPU work that must not slow the step loop), turns each step's new tokens into:

- text, detokenized *incrementally*: only a short window of tokens is decoded per step,
  and a delta is released only once it is a complete character (a multi-byte UTF-8 char
  can be split over tokens: "é" may arrive as two byte tokens);
- stop strings: text is searched for them as it grows; the returned text never includes
  one (unless include_stop_str_in_output), and the caller aborts the request in the
  engine. While streaming, the last len(longest stop) - 1 characters are held back, so a
  client never sees the start of a stop string that is then cut;
- `RequestOutput`s in vLLM's shape: `OutputProcessor` gathers an n > 1 request's n children
  and says which requests a stop string ended (the front end aborts them in the engine).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from nanoserve.sampling_params import SamplingParams
from nanoserve.request import EngineCoreOutput, Request

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
# Decode from this many prompt tokens before the output: tokenizers such as SentencePiece
# drop a token's leading space when it is decoded alone at the start of a string.
CONTEXT_TOKENS = 5


@dataclass
class Logprob:
    logprob: float
    rank: Optional[int] = None
    decoded_token: Optional[str] = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: Optional[str] = None       # "stop" | "length" | "abort"
    stop_reason: Optional[int | str] = None   # the stop token id or stop string that ended it
    logprobs: Optional[list[dict[int, Logprob]]] = None   # per token: {token id: Logprob}

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False


def load_tokenizer(config, model_path):
    """The HF tokenizer, or None with skip_tokenizer_init (token-id prompts only)."""
    if config.skip_tokenizer_init:
        return None
    from transformers import AutoTokenizer
    source = config.tokenizer or model_path
    advice = "set tokenizer, or skip_tokenizer_init to run prompt_token_ids without one"
    # transformers 5 builds an empty tokenizer for some model types when the files are missing.
    if Path(source).is_dir() and not any((Path(source) / f).is_file() for f in TOKENIZER_FILES):
        raise ValueError(f"no tokenizer files ({', '.join(TOKENIZER_FILES)}) in {source}; {advice}")
    try:
        return AutoTokenizer.from_pretrained(source)
    except (OSError, ValueError) as e:   # files transformers cannot read
        raise ValueError(f"could not load a tokenizer from {source} ({type(e).__name__}: {e}); "
                         f"{advice}") from None


class IncrementalDetokenizer:
    """Text of a growing token list, decoded over a sliding window (prefix_offset..end)."""

    def __init__(self, tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids = list(prompt_token_ids[-CONTEXT_TOKENS:])
        self.prefix_offset = 0                 # start of the decoding window
        self.read_offset = len(self.token_ids)  # tokens before this are already in the text

    def decode_new(self, token_ids: list[int]) -> str:
        """Append tokens; return the new complete text (may be '' while a char is split)."""
        self.token_ids += token_ids
        decode = lambda ids: self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)
        prefix_text = decode(self.token_ids[self.prefix_offset:self.read_offset])
        new_text = decode(self.token_ids[self.prefix_offset:])
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return ""   # nothing printable yet, or a multi-byte character still incomplete
        self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        return new_text[len(prefix_text):]


class RequestState:
    """One completion's text, tokens and stop-string state."""

    def __init__(self, request_id: str, index: int, prompt_token_ids: list[int],
                 params: SamplingParams, tokenizer):
        self.request_id = request_id
        self.index = index
        self.params = params
        self.tokenizer = tokenizer
        # No tokenizer (skip_tokenizer_init): token ids only, the text stays "".
        self.detokenizer = None if tokenizer is None else IncrementalDetokenizer(
            tokenizer, prompt_token_ids, params.skip_special_tokens)
        self.text = ""
        self.sent = 0                     # characters of `text` already streamed
        self.sent_tokens = 0              # tokens already streamed
        self.token_ids: list[int] = []
        self.logprobs: Optional[list[dict[int, Logprob]]] = [] if params.logprobs is not None else None
        self.finish_reason: Optional[str] = None
        self.stop_reason: Optional[int | str] = None

    def process(self, out: EngineCoreOutput) -> bool:
        """Take one engine output. True when a stop string ended the request here (the
        caller must then abort it in the engine)."""
        if self.logprobs is not None and out.new_logprobs is not None:
            self.logprobs.append(self._logprob_dict(out.new_token_ids[-1], out.new_logprobs))
        stopped_by_string = False
        # Several tokens come from one step under speculative decoding: one at a time, so that
        # a stop string cuts the run at the token that completed it.
        for token in out.new_token_ids:
            self.token_ids.append(token)
            delta = self.detokenizer.decode_new([token]) if self.detokenizer else ""
            if self.params.stop and self.finish_reason is None:
                stopped_by_string = self._append_and_check_stop(delta)
                if stopped_by_string:
                    break
            else:
                self.text += delta
        if self.finish_reason is None and out.finish_reason is not None:
            self.finish_reason, self.stop_reason = out.finish_reason, out.stop_reason
        return stopped_by_string

    def _append_and_check_stop(self, delta: str) -> bool:
        # Only the tail can hold a new match: the old text was already searched.
        start = max(0, len(self.text) - max(len(s) for s in self.params.stop) + 1)
        self.text += delta
        hits = [(i, s) for s in self.params.stop if (i := self.text.find(s, start)) != -1]
        if not hits:
            return False
        index, stop = min(hits)
        self.text = self.text[:index + (len(stop) if self.params.include_stop_str_in_output else 0)]
        self.finish_reason, self.stop_reason = "stop", stop
        return True

    def _logprob_dict(self, token_id: int, lp) -> dict[int, Logprob]:
        decode = lambda t: None if self.tokenizer is None else self.tokenizer.decode([t])
        entries = {t: Logprob(v, rank, decode(t)) for rank, (t, v) in enumerate(lp.top, start=1)}
        entries.setdefault(token_id, Logprob(lp.logprob, lp.rank, decode(token_id)))
        return entries

    def new_text(self) -> str:
        """Text not yet streamed, holding back what could still become a stop string."""
        end = len(self.text)
        if self.params.stop and self.finish_reason is None:
            end -= max(len(s) for s in self.params.stop) - 1
        delta = self.text[self.sent:max(end, self.sent)]
        self.sent += len(delta)
        return delta

    def delta(self) -> CompletionOutput:
        """What is new since the last delta (the streaming form of `completion`)."""
        start, self.sent_tokens = self.sent_tokens, len(self.token_ids)
        return CompletionOutput(self.index, self.new_text(), self.token_ids[start:],
                                self.finish_reason, self.stop_reason,
                                None if self.logprobs is None else self.logprobs[start:])

    def completion(self) -> CompletionOutput:
        return CompletionOutput(self.index, self.text, list(self.token_ids), self.finish_reason,
                                self.stop_reason, self.logprobs)


class OutputProcessor:
    """Every live request's RequestStates: each step's EngineCoreOutputs in, one RequestOutput per
    request that gained something out (its new text and tokens), plus the ids to abort."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._states: dict[str, tuple[str, RequestState]] = {}   # child id -> (request id, state)
        self._children: dict[str, list[str]] = {}                # request id -> child ids
        self.num_generation_tokens_total = 0

    def add_request(self, request_id: str, children: list[Request]) -> None:
        self._children[request_id] = [c.request_id for c in children]
        for index, child in enumerate(children):
            self._states[child.request_id] = (request_id, RequestState(
                child.request_id, index, child.prompt_token_ids, child.sampling_params,
                self.tokenizer))

    def process_outputs(self, outputs: list[EngineCoreOutput]) -> tuple[list[RequestOutput], list[str]]:
        """Feed each output to its state; returns the deltas (one RequestOutput per request) and
        the child ids a stop string ended, which the caller must abort in the engine."""
        deltas: dict[str, list[CompletionOutput]] = {}
        stopped = []
        for out in outputs:
            if out.request_id not in self._states:
                continue                     # its stream has already gone away
            request_id, state = self._states[out.request_id]
            if state.process(out):
                stopped.append(out.request_id)
            self.num_generation_tokens_total += len(out.new_token_ids)
            deltas.setdefault(request_id, []).append(state.delta())
        return [RequestOutput(rid, None, [], completions, self.finished(rid))
                for rid, completions in deltas.items()], stopped

    def child_ids(self, request_id: str) -> list[str]:
        """The engine request ids of a live request's completions ([] once it is removed)."""
        return list(self._children.get(request_id, []))

    def parent_id(self, child_id: str) -> Optional[str]:
        """The request a completion belongs to, or None once that request is removed."""
        entry = self._states.get(child_id)
        return None if entry is None else entry[0]

    def finished(self, request_id: str) -> bool:
        return all(self._states[c][1].finish_reason is not None for c in self._children[request_id])

    def completions(self, request_id: str) -> list[CompletionOutput]:
        """The request's completions whole, in index order."""
        return [self._states[c][1].completion() for c in self._children[request_id]]

    def remove(self, request_id: str) -> list[str]:
        """Forget a request; returns its child ids (to abort those still in the engine)."""
        children = self._children.pop(request_id, [])
        for child_id in children:
            self._states.pop(child_id, None)
        return children
