"""api.py: the OpenAI-compatible HTTP server (`nanoserve serve`), in the engine's language.

A request: check the Host header and origin (http_limits.py), the API key, that the body is
`application/json`; read at most MAX_BODY_BYTES, parse strict JSON, check each field's type
(SamplingParams checks the ranges), apply the chat template and tokenize on the tokenizer's
thread, refuse a prompt + max_tokens beyond max_model_len: any failure is OpenAI's error JSON
(naming no other client's request) and nothing reaches the engine. Then one
`AsyncLLM.generate` stream per prompt (choice k of prompt i is choice i * n + k),
drained by tasks into one queue (`Generation`, which also times tokens for /metrics), answered as
one JSON body or as Server-Sent Events. A client that leaves cancels the drain tasks; cancelling
`generate` aborts the request, whose blocks the engine frees before its next step.

Lesson: lessons/01-the-map.md
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import json
import secrets
import time
import uuid
from typing import AsyncIterator, Callable, Optional, Sequence

from jinja2 import TemplateError
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from rich.console import Console
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from nanoserve.engine import AsyncLLM
from nanoserve.http_limits import LOOPBACK_HOSTS, http_middleware
from nanoserve.output_processor import CompletionOutput
from nanoserve.protocol import (CHAT_FIELDS, COMPLETION_FIELDS, APIError, api_error_of, is_type,
                                loads_body, own_ids_only, parse_body, sampling_params_of)
from nanoserve.sampling_params import SamplingParams

MAX_BODY_BYTES = 8 * 1024 * 1024     # 413 above this: ~1M token ids of JSON, far past any prompt
# -- one HTTP request's generation ---------------------------------------------------------
class Generation:
    """One HTTP request's engine streams (one per prompt) merged into one stream of deltas, whose
    `index` is the choice index. It watches the connection: Starlette does not for a handler."""

    def __init__(self, server: OpenAIServer, request: Request, request_id: str,
                 prompts: list[list[int]], params: SamplingParams):
        self.server, self.request_id, self.n = server, request_id, params.n
        self.start_time, self.first_token_time = time.perf_counter(), None
        self.num_prompt_tokens, self.num_output_tokens = sum(map(len, prompts)), 0
        self.status = "aborted"           # until the last output is read ("finished"), or "error"
        self._queue: asyncio.Queue = asyncio.Queue()   # (prompt index, RequestOutput | APIError)
        self._early: list = []            # outputs start() read ahead of outputs()
        self._running = len(prompts)
        self._tasks = [asyncio.create_task(self._drain(i, server.engine.generate(
            {"prompt_token_ids": ids}, params, f"{request_id}-{i}")))
            for i, ids in enumerate(prompts)]
        self._watch = asyncio.create_task(self._watch_disconnect(request))

    async def _watch_disconnect(self, request: Request) -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass
        for task in self._tasks:
            task.cancel()
        self._queue.put_nowait((None, APIError(499, "the client disconnected")))  # to no one

    async def _drain(self, i: int, stream: AsyncIterator) -> None:
        last = None
        try:
            async for out in stream:
                now = time.perf_counter()
                if any(c.token_ids for c in out.outputs):
                    histogram, since = ((self.server.ttft, self.start_time) if last is None
                                        else (self.server.itl, last))
                    histogram.observe(now - since)
                    self.first_token_time, last = self.first_token_time or now, now
                if out.finished:
                    self.server.e2e.observe(now - self.start_time)
                self._queue.put_nowait((i, out))
        except Exception as e:       # whatever it is, it ends this request alone (500 if a bug)
            self.status = "error"
            self._queue.put_nowait((i, api_error_of(e, self.request_id)))

    async def _next(self):
        i, item = await self._queue.get()
        if isinstance(item, APIError):
            raise item
        return i, item

    async def start(self) -> None:
        """Wait for every prompt's first output, so that an error the engine raises up front
        becomes an HTTP error status, not a broken stream."""
        while len({i for i, _ in self._early}) < len(self._tasks):
            self._early.append(await self._next())

    async def outputs(self) -> AsyncIterator[CompletionOutput]:
        """Each new piece of any choice, as it arrives, until every choice has finished."""
        while self._running:
            i, out = self._early.pop(0) if self._early else await self._next()
            self._running -= out.finished
            for c in out.outputs:
                self.num_output_tokens += len(c.token_ids)
                yield dataclasses.replace(c, index=i * self.n + c.index)
        self.status = "finished"

    async def collect(self) -> list[CompletionOutput]:
        """Every choice whole, in choice order (the non-streaming answer)."""
        whole: dict[int, CompletionOutput] = {}
        async for c in self.outputs():
            w = whole.setdefault(c.index, CompletionOutput(c.index, "", []))
            w.text, w.token_ids = w.text + c.text, w.token_ids + c.token_ids
            w.logprobs = None if c.logprobs is None else (w.logprobs or []) + c.logprobs
            w.finish_reason = c.finish_reason
        return [whole[k] for k in sorted(whole)]

    def usage(self) -> dict:
        p, o = self.num_prompt_tokens, self.num_output_tokens
        return {"prompt_tokens": p, "completion_tokens": o, "total_tokens": p + o}

    def close(self) -> None:
        """Cancel what still runs (cancelling `generate` aborts the request); log the line."""
        for task in self._tasks + [self._watch]:
            task.cancel()
        start, first = self.start_time, self.first_token_time
        self.server.console.print(
            f"[dim]{time.strftime('%H:%M:%S')}[/] {self.request_id} {self.status}: "
            f"{self.num_prompt_tokens} prompt + {self.num_output_tokens} output tokens, ttft "
            f"{f'{first - start:.3f}s' if first else '-'}, total {time.perf_counter() - start:.3f}s",
            soft_wrap=True)


# -- response shapes: a choice from a CompletionOutput (one delta, or a whole completion) -----
def _top(entries: dict, n: int) -> list:
    """The n most likely of one token's logprob entries, best first."""
    return sorted((lp for lp in entries.values() if lp.rank <= n), key=lambda lp: lp.rank)


def _completion_logprobs(c: CompletionOutput, n: int, offset: int) -> dict:
    """Completions-style logprobs; text_offset counts from `offset`, the choice's text so far."""
    sampled = [lps[t] for t, lps in zip(c.token_ids, c.logprobs)]
    return {"tokens": [lp.decoded_token for lp in sampled],
            "token_logprobs": [lp.logprob for lp in sampled],
            "top_logprobs": [{lp.decoded_token: lp.logprob for lp in _top(lps, n)}
                             for lps in c.logprobs],
            "text_offset": list(itertools.accumulate((len(lp.decoded_token) for lp in sampled[:-1]),
                                                     initial=offset))[:len(sampled)]}


def _chat_choice(c: CompletionOutput, n: Optional[int], streaming: bool) -> dict:
    entry = lambda lp: {"token": lp.decoded_token, "logprob": lp.logprob,
                        "bytes": list(lp.decoded_token.encode())}
    logprobs = None if n is None else {"content": [
        {**entry(lps[t]), "top_logprobs": [entry(lp) for lp in _top(lps, n)]}
        for t, lps in zip(c.token_ids, c.logprobs)]}
    message = ({"delta": {"content": c.text} if c.text else {}} if streaming else
               {"message": {"role": "assistant", "content": c.text}})
    return {"index": c.index, **message, "logprobs": logprobs, "finish_reason": c.finish_reason}


# -- the app -------------------------------------------------------------------------------
async def _error(request: Request, exc: APIError | HTTPException) -> Response:
    """APIErrors, and Starlette's own (unknown route, wrong method), as OpenAI's error JSON."""
    return (exc if isinstance(exc, APIError) else APIError(exc.status_code, exc.detail)).response()


class OpenAIServer(Starlette):
    """The app: routes to the handlers below; it shuts the engine down when the server stops."""

    def __init__(self, engine: AsyncLLM, model_name: str, api_key: Optional[str],
                 allowed_hosts: Sequence[str], allowed_origins: Sequence[str]):
        self.engine, self.model_name, self.api_key = engine, model_name, api_key
        self.tokenizer, self.max_model_len = engine.tokenizer, engine.config.max_model_len
        self.console, self.created = Console(stderr=True), int(time.time())
        # /metrics: a registry of this app's own (apps may share a process); the engine's stats
        # are read at scrape time (`collect`), the histograms observed by each Generation.
        self.registry = CollectorRegistry()
        self.registry.register(self)
        fast, slow = [.001 * 2 ** i for i in range(15)], [.01 * 2 ** i for i in range(15)]
        self.ttft, self.itl, self.e2e = (
            Histogram(f"nanoserve:{name}", doc, buckets=buckets, registry=self.registry)
            for name, doc, buckets in (
                ("time_to_first_token_seconds", "Arrival to first token.", fast),   # 1 ms..16 s
                ("inter_token_latency_seconds", "Between two outputs of a request.", fast),
                ("e2e_request_latency_seconds", "Arrival to last token.", slow)))  # 10 ms..164 s
        @contextlib.asynccontextmanager
        async def lifespan(app):
            yield
            await engine.shutdown()
        super().__init__(routes=[
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/chat/completions", self.chat, methods=["POST"]),
            Route("/v1/models", self.models),
            Route("/health", lambda request: Response() if engine.dead_error is None   # 503 and
                  else APIError(503, own_ids_only(str(engine.dead_error))).response()),   # why
            Route("/metrics", lambda request: Response(generate_latest(self.registry),
                                                       media_type=CONTENT_TYPE_LATEST)),
        ], lifespan=lifespan, exception_handlers={APIError: _error, HTTPException: _error},
            middleware=http_middleware(allowed_hosts, allowed_origins))

    def _authorize(self, request: Request) -> None:
        if self.api_key is not None and not secrets.compare_digest(
                request.headers.get("authorization", "").encode(), f"Bearer {self.api_key}".encode()):
            raise APIError(401, "invalid or missing API key: send 'Authorization: Bearer <key>'",
                           code="invalid_api_key")

    async def _read(self, request: Request, schema: dict, required: tuple[str, ...]) -> dict:
        self._authorize(request)
        # JSON only: a browser sends a text/plain or form POST cross-site without asking first.
        media_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if media_type != "application/json":
            raise APIError(415, "the request body must be JSON, sent with 'Content-Type: "
                           f"application/json' (got {media_type or 'none'!r:.80})")
        raw = bytearray()
        async for chunk in request.stream():
            raw += chunk
            if len(raw) > MAX_BODY_BYTES:
                raise APIError(413, f"the request body is over {MAX_BODY_BYTES} bytes")
        body = parse_body(loads_body(bytes(raw)), schema, required)
        if body["model"] != self.model_name:
            raise APIError(404, f"the model {body['model']!r} does not exist; this server serves "
                           f"{self.model_name!r}", "model", "model_not_found")
        return body

    def _check_length(self, ids: list[int], max_tokens: Optional[int], param: str) -> None:
        if not ids:
            raise APIError(400, "the prompt is empty", param)
        wanted = max_tokens or 1          # None: as many as fit, but at least one must
        if len(ids) + wanted > self.max_model_len:
            raise APIError(400, f"the prompt ({len(ids)} tokens) + max_tokens ({wanted}) = "
                           f"{len(ids) + wanted} tokens, over this model's context length "
                           f"(max_model_len {self.max_model_len})", "max_tokens" if max_tokens
                           else param)

    def _check_sequences(self, num_prompts: int, n: int) -> None:
        """prompts x n sequences in one request: over max_waiting_requests it could never be
        admitted (admission counts sequences), so it is a 400 before any tokenizing."""
        limit = self.engine.config.max_waiting_requests
        if num_prompts * n > limit:
            raise APIError(400, f"{num_prompts} prompt(s) x n {n} = {num_prompts * n} sequences "
                           f"in one request, over max_waiting_requests ({limit})",
                           "n" if n > 1 else "prompt")

    def _encode(self, prompt: str | list[int], max_tokens: Optional[int], param: str,
                add_special_tokens: bool = True) -> list[int]:
        """A prompt's token ids, checked to fit (a text is encoded: on the tokenizer's thread)."""
        try:
            ids = prompt if isinstance(prompt, list) else self.engine.processor.encode(
                prompt, add_special_tokens)
        except ValueError as e:           # a text too long to ever fit
            raise APIError(400, str(e), param) from None
        self._check_length(ids, max_tokens, param)
        return ids

    async def completions(self, request: Request) -> Response:
        body = await self._read(request, COMPLETION_FIELDS, ("model", "prompt"))
        if body.get("echo") and "logprobs" in body:   # it would need the prompt's logprobs
            raise APIError(400, "echo with logprobs is not supported", "echo")
        params = sampling_params_of(body, logprobs=body.get("logprobs"))
        prompt = body["prompt"]           # one prompt, or a batch of them
        prompts = [prompt] if isinstance(prompt, str) or is_type(prompt, "array of integer") else prompt
        self._check_sequences(len(prompts), params.n)

        def encode() -> tuple[list[list[int]], dict[int, str]]:   # on the tokenizer's thread
            ids = [self._encode(p, params.max_tokens, "prompt") for p in prompts]
            return ids, {i * params.n + k: p if isinstance(p, str) else self.tokenizer.decode(p)
                         for i, p in enumerate(prompts) for k in range(params.n)
                         } if body.get("echo") else {}
        ids, echo = await self.engine.run_in_tokenizer_thread(encode)
        sent: dict[int, int] = {}        # choice index -> characters sent (for text_offset)

        def choice(c: CompletionOutput, streaming: bool) -> dict:
            logprobs = None if params.logprobs is None else _completion_logprobs(
                c, params.logprobs, sent.get(c.index, 0))
            sent[c.index] = sent.get(c.index, 0) + len(c.text)
            return {"index": c.index, "text": echo.pop(c.index, "") + c.text,
                    "logprobs": logprobs, "finish_reason": c.finish_reason}
        return await self._generate(request, body, ids, params,
                                    ("cmpl", "text_completion", "text_completion"), choice, [])

    async def chat(self, request: Request) -> Response:
        body = await self._read(request, CHAT_FIELDS, ("model", "messages"))
        if "top_logprobs" in body and not body.get("logprobs"):
            raise APIError(400, "top_logprobs needs logprobs: true", "top_logprobs")
        params = sampling_params_of(
            body, max_tokens=body.get("max_completion_tokens", body.get("max_tokens")),
            logprobs=body.get("top_logprobs", 0) if body.get("logprobs") else None)
        if not all(isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                   for m in body["messages"]):
            raise APIError(400, "each message needs a string 'role' and 'content'", "messages")
        self._check_sequences(1, params.n)

        def encode() -> list[int]:       # on the tokenizer's thread
            try:
                text = self.tokenizer.apply_chat_template(body["messages"], tokenize=False,
                                                          add_generation_prompt=True)
            except (ValueError, TemplateError) as e:   # no template, or one refusing these roles
                raise APIError(400, f"the chat template failed: {e}", "messages") from None
            return self._encode(text, params.max_tokens, "messages", add_special_tokens=False)
        ids = await self.engine.run_in_tokenizer_thread(encode)   # (the template has the BOS)
        role = [{"index": k, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                 "finish_reason": None} for k in range(params.n)]   # the first delta of each choice
        return await self._generate(
            request, body, [ids], params, ("chatcmpl", "chat.completion", "chat.completion.chunk"),
            lambda c, streaming: _chat_choice(c, params.logprobs, streaming), role)

    async def _compile_grammar(self, body: dict, params: SamplingParams) -> None:
        """A bad schema, regex or grammar is a 400 before anything runs, naming the field the
        client used (response_format or structured_outputs)."""
        try:
            await self.engine.compile_grammar(params)
        except ValueError as e:
            field = ("structured_outputs" if body.get("response_format", {}).get("type", "text")
                     == "text" else "response_format")
            raise APIError(400, str(e).replace("structured_outputs", field, 1), field) from None

    async def _generate(self, request: Request, body: dict, prompts: list[list[int]],
                        params: SamplingParams, kinds: tuple[str, str, str],
                        choice: Callable[[CompletionOutput, bool], dict], opening: list[dict]):
        """Run the prompts; answer with `choice(output, streaming)` per choice (SSE: `opening`
        first) in the envelope; kinds: the id prefix, a response's object, a chunk's object."""
        (prefix, kind, chunk_kind), stream = kinds, body.get("stream")
        await self._compile_grammar(body, params)
        request_id, created = f"{prefix}-{uuid.uuid4().hex}", int(time.time())

        def envelope(choices: list[dict], usage: Optional[dict] = None, chunk: bool = True) -> dict:
            out = {"id": request_id, "object": chunk_kind if chunk else kind, "created": created,
                   "model": self.model_name, "choices": choices}
            return {**out, "usage": usage} if usage else out

        async def events():
            try:
                for first in opening:
                    yield f"data: {json.dumps(envelope([first]))}\n\n"
                async for c in generation.outputs():
                    if c.text or c.finish_reason or c.logprobs:
                        yield f"data: {json.dumps(envelope([choice(c, True)]))}\n\n"
                if body.get("stream_options", {}).get("include_usage"):
                    yield f"data: {json.dumps(envelope([], generation.usage()))}\n\n"
            except APIError as e:         # the status line is already sent: an error event
                yield f"data: {e.response().body.decode()}\n\n"
            finally:
                generation.close()
            yield "data: [DONE]\n\n"

        if self.engine.dead_error is not None:     # nothing will run: unavailable, as /health says
            raise APIError(503, own_ids_only(str(self.engine.dead_error), request_id))
        generation = Generation(self, request, request_id, prompts, params)
        try:
            whole = await (generation.start() if stream else generation.collect())
        except BaseException:
            generation.close()
            raise
        if stream:
            return StreamingResponse(events(), media_type="text/event-stream")
        generation.close()
        return JSONResponse(envelope([choice(c, False) for c in whole], generation.usage(), False))

    def collect(self):                    # the registry's call, at each scrape
        """The engine cores' series labelled by data-parallel rank (engine="0", ...), as vLLM
        labels them; the front end's own counters without a label."""
        per_engine = self.engine.engine_stats
        for name, value in self.engine.get_stats().items():
            family = CounterMetricFamily if name.endswith("_total") else GaugeMetricFamily
            if name not in per_engine[0]:
                yield family(f"nanoserve:{name}", f"AsyncLLM.get_stats()['{name}']", value=value)
                continue
            per_position = isinstance(value, list)    # one sample per draft position (spec decode)
            labelled = family(f"nanoserve:{name}", f"AsyncLLM.engine_stats[i]['{name}']",
                              labels=["engine", "position"] if per_position else ["engine"])
            for index, stats in enumerate(per_engine):
                if not per_position:
                    labelled.add_metric([str(index)], stats[name])
                    continue
                for position, count in enumerate(stats[name]):
                    labelled.add_metric([str(index), str(position)], count)
            yield labelled

    async def models(self, request: Request) -> Response:
        self._authorize(request)
        return JSONResponse({"object": "list", "data": [{
            "id": self.model_name, "object": "model", "created": self.created,
            "owned_by": "nanoserve", "max_model_len": self.max_model_len}]})


def build_app(engine: AsyncLLM, served_model_name: str, api_key: Optional[str] = None,
              allowed_hosts: Sequence[str] = LOOPBACK_HOSTS,
              allowed_origins: Sequence[str] = ()) -> Starlette:
    """The app serving `engine` as `served_model_name`; with `api_key`, /v1/* needs
    `Authorization: Bearer <api_key>`. It answers Host headers naming `allowed_hosts` only
    (["*"]: any), and cross-origin browser calls from `allowed_origins` only (http_limits.py)."""
    return OpenAIServer(engine, served_model_name, api_key, allowed_hosts, allowed_origins)
