"""engine.py: the front ends over the engine core: `LLM` (offline) and `AsyncLLM` (the server's).

    from nanoserve import LLM, SamplingParams
    llm = LLM()                                     # the built-in nanoserve-tiny
    out = llm.generate(["Once upon a time"], SamplingParams(temperature=0, max_tokens=32))
    print(out[0].outputs[0].text)

The engine core (engine_core.py) speaks token ids only. Both front ends do the same three
things around it: `Processor` (processor.py) turns a prompt into engine Requests (tokenize,
validate with `check_fits`, fan out n > 1), `OutputProcessor` (output_processor.py) turns the
engine's token ids back into text and stop strings, and they talk to the engine core through its
methods alone (`LLM` steps it itself; `AsyncLLM` through a client, core_client.py, with the
core in its own process or in a thread). An n > 1 request becomes n child requests with
the same prompt, which share the prompt's KV blocks through the prefix cache, as in vLLM V1.

Lesson: lessons/01-the-map.md
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import multiprocessing
import time
from concurrent.futures import ThreadPoolExecutor
from typing import AsyncIterator, Callable, Iterator, Optional, Sequence, TypeVar, Union

from nanoserve import structured_output
from nanoserve.config import DEFAULT_MODEL, Config
from nanoserve.core_client import InprocClient, MPClient
from nanoserve.engine_core import EngineCore
from nanoserve.errors import EngineDeadError, EngineOverloadedError, RequestTimeoutError
from nanoserve.output_processor import OutputProcessor, RequestOutput, load_tokenizer
from nanoserve.processor import PromptType, Processor
from nanoserve.request import Request
from nanoserve.sampling_params import SamplingParams

T = TypeVar("T")


class LLM:
    """Offline, synchronous generation: `LLM(model, **config_fields).generate(prompts, params)`.
    The engine core lives in this process and `LLM` steps it itself."""

    def __init__(self, model: str = DEFAULT_MODEL, **kwargs):
        if kwargs.get("data_parallel_size", 1) != 1:
            raise ValueError("data_parallel_size: the offline LLM steps one engine core itself; "
                             "for data parallel use the server: nanoserve serve "
                             "--data-parallel-size N")
        self.engine = EngineCore(Config(model=model, **kwargs))
        self.config = self.engine.config
        self.tokenizer = load_tokenizer(self.config, self.engine.model_path)
        self.processor = Processor(self.config, self.tokenizer, self.engine.vocab_size,
                                   self.engine.model_path)
        self.output_processor = OutputProcessor(self.tokenizer)
        self._ids = itertools.count()

    def generate(self, prompts: Union[PromptType, Sequence[PromptType]],
                 sampling_params: Union[None, SamplingParams, Sequence[SamplingParams]] = None,
                 *, progress: bool = True) -> list[RequestOutput]:
        """Generate for every prompt; returns one RequestOutput per prompt, in input order."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"sampling_params must be one SamplingParams or one per prompt "
                             f"(got {len(sampling_params)} for {len(prompts)} prompts)")
        # Validate everything before adding anything: a bad prompt must not leave the others
        # half-added to the engine.
        outputs, requests = [], []
        for prompt, params in zip(prompts, sampling_params):
            text, ids = self.processor.prompt_token_ids(prompt)
            request_id = str(next(self._ids))
            requests.append(self.processor.make_requests(request_id, ids, params))
            outputs.append(RequestOutput(request_id, text, ids, [], finished=True))
        try:
            for output, children in zip(outputs, requests):
                self._add(output.request_id, children)
            self._run(sum(map(len, requests)), progress)
            for output in outputs:
                output.outputs = self.output_processor.completions(output.request_id)
        finally:           # (a request that failed alone raised: the others must not run on)
            for output in outputs:
                self.engine.abort(self.output_processor.remove(output.request_id))
        return outputs

    def stream(self, prompt: PromptType, sampling_params: Optional[SamplingParams] = None
               ) -> Iterator[str]:
        """Generate for one prompt (n = 1), yielding text as it is produced."""
        params = sampling_params or SamplingParams()
        if params.n != 1:
            raise ValueError(f"n must be 1 when streaming (got {params.n})")
        _, ids = self.processor.prompt_token_ids(prompt)
        request_id = str(next(self._ids))
        self._add(request_id, self.processor.make_requests(request_id, ids, params))
        try:
            for outputs in self._steps():
                for output in outputs:
                    if output.outputs[0].text:
                        yield output.outputs[0].text
        finally:
            self.engine.abort(self.output_processor.remove(request_id))

    def _add(self, request_id: str, children: list[Request]) -> None:
        self.output_processor.add_request(request_id, children)
        for request in children:
            self.engine.add_request(request)

    def _steps(self) -> Iterator[list[RequestOutput]]:
        """Step the engine until it is idle, aborting the requests a stop string ended; yields
        each step's RequestOutputs (what is new). A request that failed alone raises its error."""
        while self.engine.has_unfinished_requests():
            outputs, stopped = self.output_processor.process_outputs(self.engine.step())
            self.engine.abort(stopped)
            if failed := self.engine.pop_failed():
                raise next(iter(failed.values()))
            yield outputs

    def _run(self, total: int, progress: bool) -> None:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
        columns = (TextColumn("generating"), BarColumn(), MofNCompleteColumn(),
                   TextColumn("{task.fields[tps]:.1f} tok/s"), TimeElapsedColumn())
        start, tokens, done = time.perf_counter(), 0, 0
        with Progress(*columns, disable=not progress) as bar:
            task = bar.add_task("generate", total=total, tps=0.0)
            for outputs in self._steps():
                done += sum(c.finished for output in outputs for c in output.outputs)
                tokens += sum(len(c.token_ids) for output in outputs for c in output.outputs)
                bar.update(task, completed=done, tps=tokens / (time.perf_counter() - start))


class AsyncLLM:
    """The engine for a server: many concurrent `generate` streams over one engine core.

        async for out in engine.generate("Hello", SamplingParams(max_tokens=8), "req-1"):
            print(out.outputs[0].text, end="")      # each output holds only what is new

    The engine core runs its own busy loop, in a process of its own (`engine_process`, the
    default; with `data_parallel_size` N, N of them, the client balancing requests between
    them) or in a thread (core_client.py); this side sends it requests and aborts, and
    one task (`_handle_outputs`) takes each step's outputs, turns them into text and puts
    every request's new text on that request's own queue. A failed step fails only the
    requests that were in it; an engine core that stops (an error in its loop, or its
    process died) fails every open stream with EngineDeadError, and so does every new request
    (the server's /health then answers 503).
    """

    def __init__(self, model: str = DEFAULT_MODEL, **kwargs):
        config = Config(model=model, **kwargs)
        self.engine_core = MPClient(config) if config.engine_process else InprocClient(config)
        self.config = self.engine_core.config
        self.tokenizer = load_tokenizer(self.config, self.engine_core.model_path)
        self.processor = Processor(self.config, self.tokenizer, self.engine_core.vocab_size,
                                   self.engine_core.model_path)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.engine_stats = list(self.engine_core.stats)   # each rank's, as of its last message
        self.dead_error: Optional[EngineDeadError] = None
        self._streams: dict[str, asyncio.Queue] = {}    # request id -> its outputs
        self._output_task: Optional[asyncio.Task] = None
        self.num_prompt_tokens_total = 0
        # Admitted, no output yet: request id -> its sequences (n); admission bounds their sum.
        self._not_started: dict[str, int] = {}
        self.num_requests_rejected_total = self.num_requests_timed_out_total = 0
        # One thread for the tokenizer and chat templates, as vLLM's server has: the event loop
        # serves on while a long prompt is encoded, and a fast tokenizer must not be called
        # from two threads at once (it raises "Already borrowed").
        self._tokenizer_thread = ThreadPoolExecutor(1, thread_name_prefix="nanoserve-tokenizer")

    async def run_in_tokenizer_thread(self, fn: Callable[..., T], *args, **kwargs) -> T:
        """fn(*args, **kwargs) on the tokenizer's thread, off the event loop, in arrival order."""
        return await asyncio.get_running_loop().run_in_executor(
            self._tokenizer_thread, functools.partial(fn, *args, **kwargs))

    async def generate(self, prompt: PromptType, sampling_params: SamplingParams,
                       request_id: str, priority: int = 0) -> AsyncIterator[RequestOutput]:
        """Yield a RequestOutput each time the request gains text, the last one finished.
        Raises ValueError (before anything reaches the engine) for a request that cannot run."""
        await self.compile_grammar(sampling_params)
        text, ids = await self.run_in_tokenizer_thread(self.processor.prompt_token_ids, prompt)
        if self.dead_error is not None:
            raise self.dead_error
        if request_id in self._streams:
            raise ValueError(f"request_id {request_id!r} is already in use")
        children = self.processor.make_requests(request_id, ids, sampling_params, priority)
        self._check_admission(len(children))
        self.run_output_handler()
        stream = self._streams[request_id] = asyncio.Queue()
        self.output_processor.add_request(request_id, children)
        self.num_prompt_tokens_total += len(ids) * len(children)
        self._not_started[request_id] = len(children)
        timeout = self.config.request_timeout_s     # one timer per request, not one per token
        timer = timeout and asyncio.get_running_loop().call_later(
            timeout, self._time_out, request_id, stream, timeout)
        finished = False
        try:
            self.engine_core.send("add", children)
            while not finished:
                item = await stream.get()
                if isinstance(item, Exception):
                    raise item
                self._not_started.pop(request_id, None)
                finished = item.finished
                yield RequestOutput(request_id, text, ids, item.outputs, finished)
        finally:
            if timer:
                timer.cancel()
            self._not_started.pop(request_id, None)
            children_ids = self.output_processor.remove(request_id)
            self._streams.pop(request_id, None)
            if not finished:       # the consumer went away (client disconnected): free it all
                self.engine_core.send("abort", children_ids)

    def run_output_handler(self) -> asyncio.Task:
        """The task of `_handle_outputs`, started on the running loop if it is not yet (vLLM's
        `_run_output_handler`): at the first request, or when a server starts (cli.py), so that
        an engine core that dies while no request is open is seen too. It ends when the engine
        is dead (or at shutdown)."""
        if self._output_task is None:
            self._output_task = asyncio.get_running_loop().create_task(self._handle_outputs())
        return self._output_task

    def _check_admission(self, num_seqs: int) -> None:
        """Admission counts sequences, not requests (n = 128 is 128 of them): past
        max_waiting_requests waiting ones, EngineOverloadedError (503, retry); a request that
        alone is more than that could never be admitted, so it is a ValueError (400)."""
        limit, waiting = self.config.max_waiting_requests, sum(self._not_started.values())
        if num_seqs > limit:
            raise ValueError(f"n ({num_seqs}) is over max_waiting_requests ({limit}): the "
                             "request could never be admitted")
        if waiting + num_seqs > limit:
            self.num_requests_rejected_total += 1
            raise EngineOverloadedError(
                f"{waiting} sequences are already waiting, {num_seqs} more would pass "
                f"max_waiting_requests ({limit}); retry later")

    async def compile_grammar(self, params: SamplingParams) -> None:
        """Processor.compile_grammar on structured_output's thread pool: a new grammar may take a
        while to compile, and the event loop must not wait for it (a cached one is done at
        once). Past COMPILE_TIMEOUT_S a ValueError; the compile goes on, unwaited (shield: a
        request with the same text may be waiting for it too)."""
        if (future := self.processor.compile_grammar(params, background=True)) is None:
            return
        try:
            await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(future)),
                                   structured_output.COMPILE_TIMEOUT_S)
        except TimeoutError:
            raise structured_output.timed_out(params.structured_outputs) from None

    def abort(self, request_id: str) -> None:
        """Cancel a request; the engine frees its blocks before the next step."""
        if children_ids := self.output_processor.child_ids(request_id):
            self.engine_core.send("abort", children_ids)

    def _time_out(self, request_id: str, stream: asyncio.Queue, timeout: float) -> None:
        self.num_requests_timed_out_total += 1
        stream.put_nowait(RequestTimeoutError(
            f"request {request_id} did not finish within request_timeout_s ({timeout:g} s); "
            "it was aborted"))

    def get_stats(self) -> dict:
        """The front end's counters, and the engine cores' stats summed over data-parallel
        ranks (kv_cache_usage_perc: their mean; `engine_stats` has each rank's)."""
        engines = {name: sum_over_ranks([stats[name] for stats in self.engine_stats])
                   for name in self.engine_stats[0]}
        engines["kv_cache_usage_perc"] /= len(self.engine_stats)
        return {**engines, "prompt_tokens_total": self.num_prompt_tokens_total,
                "generation_tokens_total": self.output_processor.num_generation_tokens_total,
                "requests_rejected_total": self.num_requests_rejected_total,
                "requests_timed_out_total": self.num_requests_timed_out_total}

    async def shutdown(self) -> None:
        if self._output_task is not None:
            self._output_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._output_task
        self._tokenizer_thread.shutdown(wait=False, cancel_futures=True)
        self.engine_core.shutdown()

    async def _handle_outputs(self) -> None:
        """Each message of the engine core: outputs to their streams, failures to theirs."""
        try:
            while True:
                message = await self.engine_core.get_output()
                if message.dead:
                    raise EngineDeadError(f"the engine core stopped: {message.error}")
                self.engine_stats[message.engine_index] = message.stats
                for child_id, error in message.failed.items():
                    self._fail(child_id, error)
                outputs, stopped = self.output_processor.process_outputs(message.outputs)
                if stopped:      # their states already hold the final text and "stop"
                    self.engine_core.send("abort", stopped)
                for output in outputs:
                    self._streams[output.request_id].put_nowait(output)
        except Exception as e:   # nothing will run any more: every open stream must hear it
            self.dead_error = e if isinstance(e, EngineDeadError) else EngineDeadError(
                f"the engine's output handler failed: {type(e).__name__}: {e}")
            for stream in self._streams.values():
                stream.put_nowait(self.dead_error)
            multiprocessing.active_children()    # reaps an engine core that exited: no zombie

    def _fail(self, child_id: str, error: Exception) -> None:
        if (request_id := self.output_processor.parent_id(child_id)) is not None:
            self.abort(request_id)               # its siblings must not run on alone
            self._streams[request_id].put_nowait(error)


def sum_over_ranks(values: list):
    """One stat summed over the data-parallel ranks; a per-position list (spec decode's accepted
    tokens per draft position) position by position: [[3, 1], [2, 0]] -> [5, 1]."""
    if isinstance(values[0], list):
        return [sum(column) for column in zip(*values)]
    return sum(values)
