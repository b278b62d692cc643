"""engine.py: the engine core's step loop, and `LLM`, the offline entry point over it.

    from nanoserve import LLM, SamplingParams
    llm = LLM()                                     # the built-in nanoserve-tiny
    out = llm.generate(["Once upon a time"], SamplingParams(temperature=0, max_tokens=32))
    print(out[0].outputs[0].text)

`EngineCore.step()` is the whole loop of the design: schedule -> the worker runs the model
and samples -> the scheduler appends tokens and checks stops. Every unfinished request
simply stays in the scheduler for the next step. The core speaks token ids only; `LLM`
(and the server's AsyncLLM) tokenize prompts and turn token ids back into text
(output_processor.py). An n > 1 request becomes n child requests with the same prompt,
which share the prompt's KV blocks through the prefix cache, as in vLLM V1.

Lesson: lessons/01-the-map.md
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import sys
import time
from typing import AsyncIterator, Iterator, Optional, Sequence, Union

from nanoserve.config import DEFAULT_MODEL, Config
from nanoserve.executor import MultiprocExecutor
from nanoserve.kv_cache import KVCacheManager
from nanoserve.output_processor import RequestOutput, RequestState, load_tokenizer
from nanoserve.sampling_params import SamplingParams
from nanoserve.scheduler import EngineCoreOutput, Request, Scheduler
from nanoserve.trace import Tracer
from nanoserve.worker import ModelRunner

PromptType = Union[str, dict]


class EngineCore:
    """Scheduler + KV cache manager + model runner, stepped by whoever drives it."""

    def __init__(self, config: Config):
        self.tracer = Tracer.open(config.trace)
        # tensor_parallel_size > 1: the same execute_model over one worker process per rank
        self.runner = ModelRunner(config) if config.tensor_parallel_size == 1 else MultiprocExecutor(config)
        self.config = config = self.runner.config        # resolved: fixed from here on
        self.kv_cache_manager = KVCacheManager(config.num_kv_blocks, config.block_size,
                                               config.enable_prefix_caching, self.tracer)
        self.scheduler = Scheduler(config, self.kv_cache_manager, self.tracer)
        # Where the time goes (seconds, summed over steps); `nanoserve bench` prints them.
        self.timings = self.runner.timings
        self.timings.update(schedule=0.0, update=0.0)
        self.num_batched_requests = 0       # summed over steps: / steps = mean batch size
        if self.tracer.enabled:
            self.tracer.emit("config", **dataclasses.asdict(config))
            self.tracer.flush()

    def add_request(self, request: Request) -> None:
        self.scheduler.add_request(request)

    def abort(self, request_ids: Sequence[str]) -> list[EngineCoreOutput]:
        return [EngineCoreOutput(r.request_id, [], "abort")
                for r in self.scheduler.abort(request_ids)]

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def step(self) -> list[EngineCoreOutput]:
        start = time.perf_counter()
        scheduler_output = self.scheduler.schedule()
        if not scheduler_output.requests:
            return []
        self.timings["schedule"] += time.perf_counter() - start
        self.num_batched_requests += len(scheduler_output.requests)
        try:
            sampled, logprobs = self.runner.execute_model(scheduler_output)
        except Exception as e:
            # The step's requests cannot go on; everyone else can. Roll their progress back
            # first, so that blocks this step should have filled leave the prefix cache.
            for request, computed in zip(scheduler_output.requests,
                                         scheduler_output.num_computed_tokens):
                request.num_computed_tokens = computed
            failed = [r.request_id for r in scheduler_output.requests]
            self.scheduler.abort(failed)
            raise EngineStepError(failed, e) from e
        update_start = time.perf_counter()
        outputs = self.scheduler.update(scheduler_output, sampled, logprobs)
        self.timings["update"] += time.perf_counter() - update_start
        if self.config.debug:
            self._debug(scheduler_output, time.perf_counter() - start)
        if self.tracer.enabled:
            self.tracer.emit("step_done", duration_s=round(time.perf_counter() - start, 6),
                             sampled=sampled)
            self.tracer.flush()
        return outputs

    def _debug(self, out, duration: float) -> None:
        pool = self.kv_cache_manager.pool
        print(f"step {self.scheduler.num_steps}: {len(out.requests)} reqs, "
              f"{out.total_num_scheduled_tokens} tokens, running {len(self.scheduler.running)} "
              f"waiting {len(self.scheduler.waiting)}, kv {pool.num_blocks - pool.num_free_blocks}"
              f"/{pool.num_blocks} used ({pool.num_cached_free_blocks} cached free), "
              f"preempted {out.preempted_req_ids or '-'}, {duration * 1e3:.1f} ms", file=sys.stderr)
        if self.config.debug >= 2:
            self.kv_cache_manager.check_invariants()


class EngineStepError(RuntimeError):
    """A step failed; `request_ids` were in it and have been aborted (the engine goes on)."""

    def __init__(self, request_ids: list[str], cause: Exception):
        super().__init__(f"the engine step failed: {type(cause).__name__}: {cause}")
        self.request_ids = request_ids


class Processor:
    """Prompt + SamplingParams -> engine Requests (tokenize, validate, fan out n > 1)."""

    def __init__(self, config: Config, tokenizer, runner: ModelRunner):
        self.config = config
        self.tokenizer = tokenizer
        self.vocab_size = runner.vocab_size
        gen_eos = _generation_config_eos(runner.model_path)
        config_eos = getattr(runner.hf_config, "eos_token_id", None)
        fallback_eos = tokenizer.eos_token_id if tokenizer is not None else (
            config_eos[0] if isinstance(config_eos, list) else config_eos)
        self.eos_token_id = gen_eos[0] if gen_eos else fallback_eos
        # Extra EOS ids (e.g. Llama 3's <|eot_id|>) stop generation unless ignore_eos.
        self.extra_eos_ids = [t for t in gen_eos if t != self.eos_token_id]

    def prompt_token_ids(self, prompt: PromptType) -> tuple[Optional[str], list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("prompt must be {'prompt_token_ids': [...]} when "
                                 "skip_tokenizer_init is set (no tokenizer to encode text)")
            return prompt, self.tokenizer.encode(prompt)
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
        seeded, seeds seed + i, so they differ yet reproduce (as in vLLM)."""
        if params.logprobs is not None and params.logprobs > self.config.max_logprobs:
            raise ValueError(f"logprobs must be <= max_logprobs ({self.config.max_logprobs}) "
                             f"(got {params.logprobs})")
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer (skip_tokenizer_init is set); "
                             "use stop_token_ids")
        if any(t >= self.vocab_size for t in params.stop_token_ids):
            raise ValueError(f"stop_token_ids must be < the vocabulary size {self.vocab_size}")
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


def _generation_config_eos(path) -> list[int]:
    from transformers import GenerationConfig
    try:
        eos = GenerationConfig.from_pretrained(path).eos_token_id
    except OSError:    # no generation_config.json: the tokenizer's EOS alone
        return []
    return [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))


class LLM:
    """Offline, synchronous generation: `LLM(model, **config_fields).generate(prompts, params)`."""

    def __init__(self, model: str = DEFAULT_MODEL, **kwargs):
        self.engine = EngineCore(Config(model=model, **kwargs))
        self.config = self.engine.config
        self.tokenizer = load_tokenizer(self.config, self.engine.runner.model_path)
        self.processor = Processor(self.config, self.tokenizer, self.engine.runner)
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
        outputs, states, requests = [], {}, []
        for prompt, params in zip(prompts, sampling_params):
            text, ids = self.processor.prompt_token_ids(prompt)
            self.engine.scheduler.check_fits(len(ids), params.max_tokens)
            request_id = str(next(self._ids))
            children = self.processor.make_requests(request_id, ids, params)
            output = RequestOutput(request_id, text, ids, [])
            for index, request in enumerate(children):
                states[request.request_id] = (output, RequestState(
                    request.request_id, index, ids, request.sampling_params, self.tokenizer))
            outputs.append(output)
            requests += children
        for request in requests:
            self.engine.add_request(request)
        self._run(states, len(requests), progress)
        for output in outputs:
            output.outputs = [state.completion() for out, state in states.values() if out is output]
            output.finished = True
        return outputs

    def stream(self, prompt: PromptType, sampling_params: Optional[SamplingParams] = None
               ) -> Iterator[str]:
        """Generate for one prompt (n = 1), yielding text as it is produced."""
        params = sampling_params or SamplingParams()
        if params.n != 1:
            raise ValueError(f"n must be 1 when streaming (got {params.n})")
        _, ids = self.processor.prompt_token_ids(prompt)
        (request,) = self.processor.make_requests(str(next(self._ids)), ids, params)
        state = RequestState(request.request_id, 0, ids, request.sampling_params, self.tokenizer)
        self.engine.add_request(request)
        for _ in self._steps({request.request_id: (None, state)}):
            delta = state.new_text()
            if delta:
                yield delta

    def _steps(self, states: dict) -> Iterator[list]:
        """Step the engine until it is idle, feeding each output to its RequestState and
        aborting the requests a stop string ended; yields each step's outputs."""
        while self.engine.has_unfinished_requests():
            outputs = self.engine.step()
            self.engine.abort([o.request_id for o in outputs
                               if states[o.request_id][1].process(o)])
            yield outputs

    def _run(self, states: dict, total: int, progress: bool) -> None:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
        columns = (TextColumn("generating"), BarColumn(), MofNCompleteColumn(),
                   TextColumn("{task.fields[tps]:.1f} tok/s"), TimeElapsedColumn())
        start, tokens, done = time.perf_counter(), 0, 0
        with Progress(*columns, disable=not progress) as bar:
            task = bar.add_task("generate", total=total, tps=0.0)
            for outputs in self._steps(states):
                done += sum(states[o.request_id][1].finish_reason is not None for o in outputs)
                tokens += sum(len(o.new_token_ids) for o in outputs)
                bar.update(task, completed=done, tps=tokens / (time.perf_counter() - start))


class AsyncLLM:
    """The engine for a server: many concurrent `generate` streams over one EngineCore.

        async for out in engine.generate("Hello", SamplingParams(max_tokens=8), "req-1"):
            print(out.outputs[0].text, end="")      # each output holds only what is new

    One background task owns the EngineCore: it takes new requests and aborts from an
    asyncio queue between steps, runs each blocking step in a worker thread
    (asyncio.to_thread) so the event loop keeps serving HTTP, and puts every request's
    new text on that request's own queue. With nothing to do it sleeps on the input queue
    instead of spinning. A failed step fails only the requests that were in it.
    """

    def __init__(self, model: str = DEFAULT_MODEL, **kwargs):
        self.engine = EngineCore(Config(model=model, **kwargs))
        self.config = self.engine.config
        self.tokenizer = load_tokenizer(self.config, self.engine.runner.model_path)
        self.processor = Processor(self.config, self.tokenizer, self.engine.runner)
        self._inputs: Optional[asyncio.Queue] = None   # ("add", [Request]) | ("abort", [ids])
        self._streams: dict[str, asyncio.Queue] = {}    # request id -> its outputs
        self._states: dict[str, tuple[str, RequestState]] = {}   # child id -> (request id, state)
        self._children: dict[str, list[str]] = {}       # request id -> child ids
        self._loop_task: Optional[asyncio.Task] = None
        self.num_prompt_tokens_total = 0
        self.num_generation_tokens_total = 0

    async def generate(self, prompt: PromptType, sampling_params: SamplingParams,
                       request_id: str, priority: int = 0) -> AsyncIterator[RequestOutput]:
        """Yield a RequestOutput each time the request gains text, the last one finished.
        Raises ValueError (before anything reaches the engine) for a request that cannot run."""
        if request_id in self._streams:
            raise ValueError(f"request_id {request_id!r} is already in use")
        text, ids = self.processor.prompt_token_ids(prompt)
        self.engine.scheduler.check_fits(len(ids), sampling_params.max_tokens)
        children = self.processor.make_requests(request_id, ids, sampling_params, priority)
        self._start()
        stream = self._streams[request_id] = asyncio.Queue()
        self._children[request_id] = [c.request_id for c in children]
        for index, child in enumerate(children):
            self._states[child.request_id] = (request_id, RequestState(
                child.request_id, index, ids, child.sampling_params, self.tokenizer))
        self.num_prompt_tokens_total += len(ids) * len(children)
        self._inputs.put_nowait(("add", children))
        finished = False
        try:
            while not finished:
                item = await stream.get()
                if isinstance(item, Exception):
                    raise item
                finished = item.finished
                yield RequestOutput(request_id, text, ids, item.outputs, finished)
        finally:
            if not finished:       # the consumer went away (client disconnected): free it all
                self.abort(request_id)
            self._forget(request_id)

    def abort(self, request_id: str) -> None:
        """Cancel a request; the engine frees its blocks before the next step."""
        if request_id in self._children and self._inputs is not None:
            self._inputs.put_nowait(("abort", self._children[request_id]))

    def get_stats(self) -> dict:
        scheduler, kv = self.engine.scheduler, self.engine.kv_cache_manager
        return {"num_requests_running": len(scheduler.running),
                "num_requests_waiting": len(scheduler.waiting),
                "kv_cache_usage_perc": kv.usage(),
                "num_preemptions_total": scheduler.num_preemptions_total,
                "prefix_cache_queries_total": kv.prefix_cache_queries,
                "prefix_cache_hits_total": kv.prefix_cache_hits,
                "prompt_tokens_total": self.num_prompt_tokens_total,
                "generation_tokens_total": self.num_generation_tokens_total}

    async def shutdown(self) -> None:
        if self._loop_task is not None:
            self._loop_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._loop_task
            self._loop_task = None
        self.engine.tracer.close()

    def _start(self) -> None:
        if self._loop_task is None or self._loop_task.done():
            self._inputs = asyncio.Queue()
            self._loop_task = asyncio.get_running_loop().create_task(self._run_engine())

    def _forget(self, request_id: str) -> None:
        self._streams.pop(request_id, None)
        for child_id in self._children.pop(request_id, []):
            self._states.pop(child_id, None)

    async def _run_engine(self) -> None:
        while True:
            if not self.engine.has_unfinished_requests():
                self._apply(await self._inputs.get())        # idle: sleep until work arrives
            while not self._inputs.empty():
                self._apply(self._inputs.get_nowait())
            try:
                outputs = await asyncio.to_thread(self.engine.step)
            except EngineStepError as e:
                for child_id in e.request_ids:
                    self._fail(child_id, e)
                continue
            self._dispatch(outputs)

    def _apply(self, item: tuple[str, list]) -> None:
        kind, payload = item
        if kind == "abort":
            self._dispatch(self.engine.abort(payload))
            return
        for request in payload:
            try:
                self.engine.add_request(request)
            except ValueError as e:   # e.g. a duplicate id: only this request fails
                self._fail(request.request_id, e)

    def _fail(self, child_id: str, error: Exception) -> None:
        if child_id in self._states:
            request_id, _ = self._states[child_id]
            self.abort(request_id)               # its siblings must not run on alone
            self._streams[request_id].put_nowait(error)

    def _dispatch(self, outputs: list[EngineCoreOutput]) -> None:
        """Feed outputs to their RequestStates; queue one RequestOutput per request."""
        by_request: dict[str, list] = {}
        stopped = []
        for out in outputs:
            if out.request_id not in self._states:
                continue                     # its stream has already gone away
            request_id, state = self._states[out.request_id]
            if state.process(out):
                stopped.append(out.request_id)
            self.num_generation_tokens_total += len(out.new_token_ids)
            by_request.setdefault(request_id, []).append(state.delta())
        self.engine.abort(stopped)   # their states already hold the final text and "stop"
        for request_id, completions in by_request.items():
            finished = all(self._states[c][1].finish_reason is not None
                           for c in self._children[request_id])
            self._streams[request_id].put_nowait(RequestOutput(request_id, None, [], completions,
                                                               finished))
