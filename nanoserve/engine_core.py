"""engine_core.py: the engine core (scheduler + KV cache manager + executor) and its busy loop.

`EngineCore.step()` is the whole loop of the design: schedule -> the executor runs the model
and samples -> the scheduler appends tokens and checks stops. Every unfinished request
simply stays in the scheduler for the next step. The core speaks token ids only.

Who steps it: the offline `LLM` calls `step()` itself; the server runs `run_busy_loop`, the
same function in either layout (core_client.py): in its own process (the default, as vLLM V1),
or in a thread of the API server's process (`--no-engine-process`). The loop takes every
request and abort that arrived, steps, and sends the step's outputs as ONE message. What one
request's row raises (a NaN or inf row, a seed no generator takes, a grammar's refusal) fails
that request alone, and the rest of the step goes on (`_fail_alone`). Any other error in a
step fails only that step's requests (the API server tells each client only its own id:
protocol.py's `own_ids_only`).
An error outside the step ends the loop, and its last message says so (`dead`), so that the
front end can fail every open stream instead of leaving them waiting. So does a step's CUDA
error (`is_fatal_step_error`): it leaves the device unusable, and every later step would fail
while /health said healthy.

Under data parallel + expert parallel (distributed.py) the N cores step in lockstep, since each
MoE layer is a collective of all of them: `must_step` asks every core once an iteration whether
any has work; if one has, all step, a core with none on a dummy row (`execute_dummy_batch`).

Lesson: lessons/01-the-map.md
"""

from __future__ import annotations

import dataclasses
import logging
import sys
import time
import traceback
from typing import Callable, Optional, Sequence

from nanoserve.config import Config
from nanoserve.distributed import SINGLE
from nanoserve.errors import EngineDeadError, EngineStepError, is_fatal_step_error
from nanoserve.kv_cache import KVCacheManager
from nanoserve.request import (EngineCoreOutput, EngineCoreOutputs, Request, RequestStatus,
                               SchedulerOutput)
from nanoserve.scheduler import Scheduler
from nanoserve.structured_output import StructuredOutputManager
from nanoserve.trace import Tracer
from nanoserve.executor import MultiprocExecutor, UniProcExecutor, join_data_parallel_experts

# Under DP+EP an idle core waits for input this long at most, then meets the other ranks' cores
# in the lockstep check again: a core blocked on its socket would leave a busy peer waiting in the
# check. vLLM wakes idle ranks instead (its DP coordinator sends a "start wave" message when any
# rank gets work): no polling, but one more process. 10 ms: a new request waits at most that
# long for the idle cores, and an idle core costs ~100 tiny all-reduces a second.
LOCKSTEP_IDLE_WAIT_S = 0.01


class EngineCore:
    """Scheduler + KV cache manager + executor, stepped by whoever drives it."""

    def __init__(self, config: Config, data_parallel_rank: int = 0,
                 expert_store: Optional[str] = None):
        self.tracer = Tracer.open(config.trace)
        # DP+EP (`expert_store`: where the ranks' group meets): on a mixture of experts this core
        # holds its rank's experts, and steps in lockstep with the other ranks' cores.
        config, tp = (join_data_parallel_experts(config, data_parallel_rank, expert_store)
                      if expert_store else (config, SINGLE))
        self.lockstep = tp.expert_exchange      # None but under DP+EP on a mixture of experts
        self.any_rank_busy = False        # under DP+EP: what the last lockstep check found
        # The runner in this process, or a worker process per TP rank: the same calls (executor.py)
        self.executor = (UniProcExecutor(config, tp) if config.tensor_parallel_size == 1
                         else MultiprocExecutor(config))
        self.config = config = self.executor.config        # resolved: fixed from here on
        # What a front end needs to know of the model (it may live in another process).
        self.vocab_size, self.model_path = self.executor.vocab_size, str(self.executor.model_path)
        self.kv_cache_manager = KVCacheManager(config.num_kv_blocks, config.block_size,
                                               config.enable_prefix_caching, self.tracer)
        self.scheduler = Scheduler(config, self.kv_cache_manager, self.tracer)
        # Structured outputs: the requests' grammar matchers and each step's bitmask.
        self.structured_output = StructuredOutputManager(config.tokenizer or self.model_path,
                                                         self.vocab_size)
        # Where the time goes (seconds, summed over steps); `nanoserve bench` prints them.
        self.timings = self.executor.timings
        self.timings.update(schedule=0.0, update=0.0, grammar=0.0)
        self.num_batched_requests = 0       # summed over steps: / steps = mean batch size
        self.failed: dict[str, Exception] = {}   # failed alone in a step, until pop_failed()
        if self.tracer.enabled:
            self.tracer.emit("config", **dataclasses.asdict(config))
            self.tracer.flush()

    def add_request(self, request: Request) -> None:
        self.scheduler.add_request(request)      # a ValueError (its id is taken) comes first
        if self.structured_output.add_request(request):     # its grammar compiles meanwhile
            request.status = RequestStatus.WAITING_FOR_FSM

    def abort(self, request_ids: Sequence[str]) -> list[EngineCoreOutput]:
        return [EngineCoreOutput(r.request_id, [], "abort")
                for r in self.scheduler.abort(request_ids)]

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def must_step(self) -> bool:
        """Whether the loop steps now: when this core has unfinished requests, or under DP+EP
        when any rank's core has (every rank runs the same number of forwards: each MoE layer is
        a collective). Every rank's core asks once an iteration: that is the lockstep."""
        busy = self.has_unfinished_requests()
        if self.lockstep:
            self.any_rank_busy = busy = self.lockstep.any_rank(busy)
        return busy

    def input_wait_s(self) -> Optional[float]:
        """How long the loop may wait for input: not at all with work to do (under DP+EP: while
        any rank had some); without, until some comes (None), but under DP+EP only
        LOCKSTEP_IDLE_WAIT_S, since a peer that gets work waits for this core in `must_step`."""
        if self.has_unfinished_requests() or self.any_rank_busy:
            return 0.0
        return LOCKSTEP_IDLE_WAIT_S if self.lockstep else None

    def get_stats(self) -> dict[str, float]:
        """The engine's side of /metrics (gauges, and counters ending in _total)."""
        scheduler, kv = self.scheduler, self.kv_cache_manager
        return {"num_requests_running": len(scheduler.running),
                "num_requests_waiting": len(scheduler.waiting),
                "kv_cache_usage_perc": kv.usage(),
                "num_preemptions_total": scheduler.num_preemptions_total,
                "prefix_cache_queries_total": kv.prefix_cache_queries,
                "prefix_cache_hits_total": kv.prefix_cache_hits, **self._spec_decode_stats()}

    def _spec_decode_stats(self) -> dict:
        """vLLM's spec-decode counters when speculation is on; the per-position one is a list
        (index = draft position), which /metrics labels with `position`."""
        scheduler = self.scheduler
        if scheduler.proposer is None:
            return {}
        return {**{f"spec_decode_{k}_total": v for k, v in scheduler.spec_counts.items()},
                "spec_decode_num_accepted_tokens_per_pos_total":
                    list(scheduler.num_accepted_tokens_per_pos)}

    def step(self) -> list[EngineCoreOutput]:
        start = time.perf_counter()
        self._update_waiting_for_fsm()
        scheduler_output = self.scheduler.schedule()
        self.structured_output.remove(scheduler_output.finished_req_ids)   # aborted, failed
        if not scheduler_output.requests:
            if self.lockstep:                   # a peer steps: meet its exchanges
                self.executor.execute_dummy_batch()
            return []
        self.timings["schedule"] += time.perf_counter() - start
        self.num_batched_requests += len(scheduler_output.requests)
        try:
            self._grammar_bitmask(scheduler_output)
            sampled, logprobs, failed = self.executor.execute_model(scheduler_output)
            failed.update(self._accept_tokens(sampled))
        except Exception as e:
            # The step's requests cannot go on; everyone else can. Roll their progress back
            # first, so that blocks this step should have filled leave the prefix cache.
            for request, computed in zip(scheduler_output.requests,
                                         scheduler_output.num_computed_tokens):
                request.num_computed_tokens = computed
            ids = [r.request_id for r in scheduler_output.requests]
            self.scheduler.abort(ids)
            logging.getLogger("nanoserve").exception("the engine step failed")
            # Every later step would fail too (or, under DP+EP, hang: the ranks' forwards no
            # longer pair up): the engine is dead.
            if is_fatal_step_error(e) or self.lockstep:
                raise EngineDeadError(f"the engine cannot go on: {type(e).__name__}: {e}") from e
            raise EngineStepError(f"the engine step failed: {type(e).__name__}: {e}", ids) from e
        if failed:
            self._fail_alone(scheduler_output, failed)
        update_start = time.perf_counter()
        outputs = self.scheduler.update(scheduler_output, sampled, logprobs)
        self.structured_output.remove(self.scheduler.finished_req_ids)   # finished just now
        self.timings["update"] += time.perf_counter() - update_start
        if self.config.debug:
            self._debug(scheduler_output, time.perf_counter() - start)
        if self.tracer.enabled:
            if self.executor.expert_load:      # a mixture of experts: tokens per expert
                self.tracer.emit("expert_load", counts=self.executor.expert_load)
            self.tracer.emit("step_done", duration_s=round(time.perf_counter() - start, 6),
                             sampled=sampled)
            self.tracer.flush()
        return outputs

    def _update_waiting_for_fsm(self) -> None:
        """Before scheduling: a request whose grammar has compiled may be admitted now (WAITING,
        in its place in the queue); one whose compile failed or ran past COMPILE_TIMEOUT_S fails
        alone (it holds no block yet). With nothing else to run, wait a moment for a compile."""
        manager = self.structured_output
        if not manager.compiling:
            return
        manager.remove(self.scheduler.finished_req_ids)       # aborted since the last step
        idle = not self.scheduler.running and len(self.scheduler.waiting) == len(manager.compiling)
        ready, failed = manager.update_fsm(wait=idle)
        for request_id in ready:
            self.scheduler.requests[request_id].status = RequestStatus.WAITING
        self.scheduler.abort(failed)
        self.failed.update(failed)

    def _grammar_bitmask(self, out: SchedulerOutput) -> None:
        """The step's one bitmask for its structured requests that sample (structured_output.py),
        into the SchedulerOutput: the runner that holds the logits (TP: rank 0) applies it."""
        start = time.perf_counter()
        mask = self.structured_output.grammar_bitmask(out)   # None: no structured row, no work
        self.timings["grammar"] += time.perf_counter() - start
        if mask is None:
            return
        out.grammar_bitmask, out.structured_output_request_ids = mask
        if self.tracer.enabled:
            self.tracer.emit("grammar_bitmask", reqs=out.structured_output_request_ids)

    def _accept_tokens(self, sampled: dict[str, list[int]]) -> dict[str, str]:
        """Advance the grammars; {request id: why} for each whose grammar refused its token
        (taken out of `sampled`)."""
        start = time.perf_counter()
        refused = self.structured_output.accept_tokens(sampled)
        self.timings["grammar"] += time.perf_counter() - start
        return {request_id: f"its grammar refused the token it sampled {sampled.pop(request_id)}"
                for request_id in refused}

    def _fail_alone(self, out: SchedulerOutput, failed: dict[str, str]) -> None:
        """The requests whose own row failed (a non-finite row, a seed no generator takes, a
        grammar's refusal) end here, each with its own error (`pop_failed`); the rest of the
        step goes on. Their progress is rolled back to nothing, so that none of their blocks
        stays in the prefix cache (what made the row fail may sit in any of them)."""
        for request in out.requests:
            if request.request_id in failed:
                request.num_computed_tokens = 0
                logging.getLogger("nanoserve").warning(
                    "request %s failed in the step: %s", request.request_id,
                    failed[request.request_id])
        self.scheduler.abort(failed)
        self.failed.update({request_id: EngineStepError(
            f"the engine step failed for this request: {why}", [request_id])
            for request_id, why in failed.items()})

    def pop_failed(self) -> dict[str, Exception]:
        """{request id: its error} of the requests that failed alone since the last call."""
        failed, self.failed = self.failed, {}
        return failed

    def _debug(self, out, duration: float) -> None:
        pool = self.kv_cache_manager.pool
        print(f"step {self.scheduler.num_steps}: {len(out.requests)} reqs, "
              f"{out.total_num_scheduled_tokens} tokens, running {len(self.scheduler.running)} "
              f"waiting {len(self.scheduler.waiting)}, kv {pool.num_blocks - pool.num_free_blocks}"
              f"/{pool.num_blocks} used ({pool.num_cached_free_blocks} cached free), "
              f"preempted {out.preempted_req_ids or '-'}, {duration * 1e3:.1f} ms", file=sys.stderr)
        if self.config.debug >= 2:
            self.kv_cache_manager.check_invariants()


# One input of the loop: ("add", [Request]), ("abort", [request id]) or ("shutdown", None).
Inputs = list[tuple[str, object]]


def run_busy_loop(core: EngineCore, get_inputs: Callable[[Optional[float]], Inputs],
                  send: Callable[[EngineCoreOutputs], None]) -> None:
    """Drain the inputs (`get_inputs(wait_s)`: what came, waiting at most `core.input_wait_s()`
    for it, None: until something comes), step, send what happened as one message. Returns on
    "shutdown"; any other exception sends `dead` and ends it."""
    try:
        while True:
            message = EngineCoreOutputs()
            inputs = get_inputs(core.input_wait_s())
            for kind, payload in inputs:
                if kind == "shutdown":
                    return
                if kind == "abort":
                    message.outputs += core.abort(payload)
                    continue
                for request in payload:
                    try:
                        core.add_request(request)
                    except ValueError as e:   # e.g. a duplicate id: only this request fails
                        message.failed[request.request_id] = e
            if core.must_step():
                try:
                    message.outputs += core.step()
                except EngineStepError as e:
                    message.failed.update(dict.fromkeys(e.request_ids, e))
                message.failed.update(core.pop_failed())
            if inputs or message.outputs or message.failed:
                message.stats = core.get_stats()
                send(message)
    except Exception as e:
        traceback.print_exc()
        why = "out of lockstep with the other data-parallel ranks (one died?): " if core.lockstep else ""
        send(EngineCoreOutputs(dead=True, error=f"{why}{type(e).__name__}: {e}"))
    finally:
        core.tracer.close()
