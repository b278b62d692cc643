"""scheduler.py: every step, who runs and how many tokens each gets (vLLM V1 semantics).

There are no prefill and decode phases. Each request has `num_computed_tokens` (tokens
whose K/V are in the cache) and `num_tokens` (prompt + output so far); a step gives it
`min(num_tokens - num_computed_tokens, token budget left)` new tokens. A decode is just
the case where that difference is 1; a long prompt split over several steps (chunked
prefill) is the case where the budget runs out first. Example, budget 8, block_size 4:

    step 1: A (prompt 10) gets 8 tokens            A computed 8/10, nothing sampled
    step 2: A gets 2 (samples its first token), B (prompt 3) gets 3 (samples too)
    step 3: A gets 1, B gets 1                      two decodes in one batch

Order within a step: running requests first (in admission order), then waiting ones
(FCFS, or by priority) while the budget, `max_num_seqs` seats and free blocks last. When
a running request cannot get a block, the last-admitted running request (under
`priority`: the lowest-priority one) is preempted: its blocks are freed, its
`num_computed_tokens` goes back to 0, and it returns to the waiting queue (recompute
preemption): at the front under FCFS, sorted into its place under `priority`. Its full blocks keep their hashes, so it usually resumes with
a prefix-cache hit. A structured request whose grammar still compiles waits as WAITING_FOR_FSM:
passed over, keeping its place, while the requests behind it are admitted (vLLM's rule).

`update()` takes the sampled tokens, applies the stop checks (EOS unless ignore_eos,
stop_token_ids, max_tokens, max_model_len; none before min_tokens) and frees finished
requests' blocks. Stop *strings* are text, so the front end checks them and aborts.

With speculative decoding on (`speculative_config`), a request whose step samples also gets up
to k draft tokens (spec_decode.py), from what is left once every request had its own tokens:
they take budget and KV slots like any token (never preempting anyone for them), and update()
takes back `num_computed_tokens` of the rejected ones, whose slots the next step overwrites.

Run the tests: `pytest tests/test_scheduler.py`; the speed: `python scripts/bench_scheduler.py`.
Lessons: lessons/03-continuous-batching.md, lessons/04-preemption.md,
lessons/08-one-step-many-tokens.md
"""

from __future__ import annotations

import bisect
from collections import deque
from typing import Any, Iterable, Optional

from nanoserve.config import Config
from nanoserve.kv_cache import KVCacheManager
from nanoserve.request import EngineCoreOutput, Request, RequestStatus, SchedulerOutput, fit_error
from nanoserve.spec_decode import NgramProposer
from nanoserve.trace import NULL_TRACER


class WaitingQueue:
    """FCFS: a deque, preempted requests go back to the front. Priority: kept sorted by
    (priority, arrival_time), so a preempted request falls back into its own place."""

    def __init__(self, policy: str):
        self.policy = policy
        self._queue: Any = deque() if policy == "fcfs" else []

    def add(self, request: Request, front: bool = False) -> None:
        if self.policy == "fcfs":
            self._queue.appendleft(request) if front else self._queue.append(request)
        else:
            bisect.insort(self._queue, request, key=_priority_key)

    def peek(self) -> Request:
        return self._queue[0]

    def pop(self) -> Request:
        return self._queue.popleft() if self.policy == "fcfs" else self._queue.pop(0)

    def remove(self, request: Request) -> None:
        self._queue.remove(request)

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self):
        return iter(self._queue)


def _priority_key(request: Request) -> tuple[int, float]:
    return (request.priority, request.arrival_time)


class Scheduler:
    def __init__(self, config: Config, kv_cache_manager: KVCacheManager, tracer=NULL_TRACER):
        assert config.max_model_len is not None and config.num_kv_blocks is not None, \
            "the scheduler needs a resolved Config (Config.resolve)"
        self.config = config
        self.kv = kv_cache_manager
        self.tracer = tracer
        self.block_size = config.block_size
        self.requests: dict[str, Request] = {}
        self.waiting = WaitingQueue(config.scheduling_policy)
        self.running: list[Request] = []    # in admission order
        self.num_steps = 0
        self.num_preemptions_total = 0
        self.finished_req_ids: set[str] = set()
        spec = config.speculative_config
        self.proposer = NgramProposer.of(spec) if spec is not None else None
        # vLLM's spec-decode counters (/metrics): steps with drafts, drafts, accepted drafts,
        # and accepted drafts by position (index j: the (j+1)-th draft of a step was kept).
        self.spec_counts = {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0}
        self.num_accepted_tokens_per_pos = [0] * (spec.num_speculative_tokens if spec else 0)

    # -- admission -----------------------------------------------------------
    def add_request(self, request: Request) -> None:
        """Queue a request (ValueError if its id is taken). Processor (processor.py) refused any
        request that could never run, so one that gets here fits: asserted, not re-checked."""
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        max_tokens = request.sampling_params.max_tokens
        assert (why := fit_error(self.config, request.num_prompt_tokens, max_tokens)) is None, \
            f"request {request.request_id} reached the scheduler unchecked: {why}"
        room = max(self.config.max_model_len - request.num_prompt_tokens, 1)
        request.max_tokens = room if max_tokens is None else min(max_tokens, room)
        self.requests[request.request_id] = request
        self.waiting.add(request)
        if self.tracer.enabled:
            self.tracer.emit("arrive", req=request.request_id, prompt_len=request.num_prompt_tokens,
                             max_tokens=request.max_tokens)

    # -- one step ------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """Running requests first, then waiting ones while budget, seats and blocks last."""
        self.num_steps += 1
        if self.tracer.enabled:
            self.tracer.step = self.num_steps
        scheduled: dict[str, int] = {}       # request id -> new tokens, in batch order
        preempted: list[Request] = []
        budget = self._schedule_running(self.config.max_num_batched_tokens, scheduled, preempted)
        if not preempted:                    # a step that had to preempt has no room to admit
            self._schedule_waiting(budget, scheduled)
        drafts = {}
        if self.proposer is not None:        # speculation gets what real work left over
            budget = self.config.max_num_batched_tokens - sum(scheduled.values())
            drafts = self._schedule_drafts(budget, scheduled)
        requests = [self.requests[rid] for rid in scheduled]
        output = SchedulerOutput(
            requests=requests,
            num_scheduled_tokens=list(scheduled.values()),
            num_computed_tokens=[r.num_computed_tokens for r in requests],
            block_tables=[self.kv.req_to_block_ids[r.request_id] for r in requests],
            preempted_req_ids=[r.request_id for r in preempted],
            finished_req_ids=self.finished_req_ids,
            scheduled_spec_decode_tokens=drafts)
        self.finished_req_ids = set()
        # vLLM advances num_computed_tokens at schedule time: the tokens are as good as
        # computed once the forward runs, and the next schedule() must not count them again.
        for request, num_new in zip(requests, output.num_scheduled_tokens):
            request.num_computed_tokens += num_new
        if self.tracer.enabled:
            self._trace_schedule(output)
        return output

    def _schedule_running(self, budget: int, scheduled: dict[str, int],
                          preempted: list[Request]) -> int:
        """Give each running request, in admission order, its new tokens; returns the budget left."""
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            victims = self._make_room(request, num_new)
            preempted += victims
            for victim in victims:            # under `priority` a victim may be scheduled already
                budget += scheduled.pop(victim.request_id, 0)
            if victims and victims[-1] is request:
                break   # the request preempted itself: nobody below it is left to free blocks
            scheduled[request.request_id] = num_new
            budget -= num_new
            i = self.running.index(request) + 1 if victims else i + 1
        return budget

    def _make_room(self, request: Request, num_new: int) -> list[Request]:
        """Allocate the request's new slots, preempting until they fit; returns the preempted
        (the request itself last, when nobody else was left to preempt)."""
        victims = []
        while self.kv.allocate_slots(request, num_new) is None:
            victim = self._pick_victim()
            self.running.remove(victim)
            self._preempt(victim)
            victims.append(victim)
            if victim is request:
                break
        return victims

    def _schedule_drafts(self, budget: int, scheduled: dict[str, int]) -> dict[str, list[int]]:
        """Propose drafts for the running requests whose step samples, while budget and free
        blocks last; their slots come from the KV manager, unhashed. Returns {id: drafts}.
        Never past max_tokens or max_model_len (the bonus token still needs its place), not for
        requests that want logprobs (each step returns one token's logprobs), and not for
        structured ones (their matcher would have to mask each draft's row and roll back)."""
        drafts: dict[str, list[int]] = {}
        limit = self.config.speculative_config.disable_by_batch_size
        if limit is not None and len(self.running) + len(self.waiting) > limit:
            return drafts
        for request in self.running:
            num_new = scheduled.get(request.request_id)
            params = request.sampling_params
            if (budget <= 0 or num_new is None or params.logprobs is not None
                    or params.structured_outputs is not None):
                continue
            if request.num_computed_tokens + num_new != request.num_tokens:
                continue    # a prefill chunk that samples nothing: nothing to verify
            room = min(budget, request.max_tokens - request.num_output_tokens - 1,
                       self.config.max_model_len - request.num_tokens - 1)
            mine = self.proposer.propose(request.all_token_ids, room) if room > 0 else []
            if mine and self.kv.allocate_slots(request, num_new + len(mine),
                                               num_lookahead_tokens=len(mine)) is not None:
                drafts[request.request_id] = mine
                scheduled[request.request_id] += len(mine)
                budget -= len(mine)
        return drafts

    def _schedule_waiting(self, budget: int, scheduled: dict[str, int]) -> None:
        """Admit waiting requests (FCFS or priority order) while budget, seats and blocks last;
        a prefix-cache hit counts as computed. A request whose grammar still compiles
        (WAITING_FOR_FSM) is passed over, keeping its place: the ones behind it may go first."""
        skipped = []
        while len(self.waiting) and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting.peek()
            if request.status == RequestStatus.WAITING_FOR_FSM:
                skipped.append(self.waiting.pop())
                continue
            hit_blocks, num_hit = self.kv.get_computed_blocks(request)
            num_new = request.num_tokens - num_hit
            if not self.config.enable_chunked_prefill and num_new > budget:
                break
            num_new = min(num_new, budget)
            if self.kv.allocate_slots(request, num_new, num_hit, hit_blocks) is None:
                break
            self.waiting.pop()
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_hit
            self.running.append(request)
            scheduled[request.request_id] = num_new
            budget -= num_new
        for request in reversed(skipped):
            self.waiting.add(request, front=True)

    def _pick_victim(self) -> Request:
        if self.config.scheduling_policy == "priority":
            return max(self.running, key=_priority_key)
        return self.running[-1]

    def _preempt(self, request: Request) -> None:
        if self.tracer.enabled:
            self.tracer.emit("preempt", req=request.request_id,
                             num_computed_tokens=request.num_computed_tokens)
        self.kv.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        self.num_preemptions_total += 1
        self.waiting.add(request, front=True)

    def update(self, output: SchedulerOutput, sampled: dict[str, list[int]],
               logprobs: Optional[dict[str, Any]] = None) -> list[EngineCoreOutput]:
        """Append each sampled token, apply the stop checks, free the finished.

        `sampled` maps request id -> its new tokens (one; with drafts, those it gained) for the
        requests that reached the end of their known tokens this step (a prefill chunk that did
        not samples nothing).
        """
        outputs = []
        finished = False
        if output.scheduled_spec_decode_tokens:
            self._take_back_rejected(output, sampled)
        for request in output.requests:
            tokens = sampled.get(request.request_id)
            if tokens is None or request.status.is_finished:
                continue
            new_tokens = []
            for token in tokens:    # the stop checks cut a verified run at the first that stops
                request.append_output_token(token)
                new_tokens.append(token)
                if self._check_stop(request, token):
                    self._finish(request)
                    finished = True
                    break
            outputs.append(EngineCoreOutput(request.request_id, new_tokens, request.finish_reason,
                                            request.stop_reason,
                                            logprobs.get(request.request_id) if logprobs else None))
        if finished:
            self.running = [r for r in self.running if not r.status.is_finished]
        return outputs

    def _take_back_rejected(self, output: SchedulerOutput, sampled: dict) -> None:
        """Speculation's bookkeeping: a request with k drafts that gains n tokens kept n - 1
        drafts, so k - (n - 1) of the slots counted as computed at schedule time hold rejected
        K/V: num_computed_tokens forgets them and the next step overwrites them. Its blocks were
        never hashed past its real tokens (allocate_slots' lookahead). Counted for /metrics."""
        accepted = {}
        for request_id, drafts in output.scheduled_spec_decode_tokens.items():
            request = self.requests.get(request_id)
            tokens = sampled.get(request_id)
            if request is None or tokens is None:   # aborted meanwhile / a TP rank's empty answer
                continue
            num_accepted = accepted[request_id] = len(tokens) - 1
            request.num_computed_tokens -= len(drafts) - num_accepted
            self.spec_counts["num_drafts"] += 1
            self.spec_counts["num_draft_tokens"] += len(drafts)
            self.spec_counts["num_accepted_tokens"] += num_accepted
            for position in range(num_accepted):
                self.num_accepted_tokens_per_pos[position] += 1
        if self.tracer.enabled:
            drafts = output.scheduled_spec_decode_tokens
            self.tracer.emit("spec_decode", accepted=accepted,
                             proposed={rid: len(drafts[rid]) for rid in accepted})

    def _check_stop(self, request: Request, token: int) -> bool:
        params = request.sampling_params
        if request.num_output_tokens >= params.min_tokens:
            # A structured request's grammar allows EOS only once it is complete
            # (structured_output.py): there it ends the request, ignore_eos or not.
            if token == request.eos_token_id and (not params.ignore_eos
                                                  or params.structured_outputs is not None):
                request.status = RequestStatus.FINISHED_STOPPED
                return True
            if token in params.stop_token_ids:
                request.status = RequestStatus.FINISHED_STOPPED
                request.stop_reason = token
                return True
        if (request.num_output_tokens >= request.max_tokens
                or request.num_tokens >= self.config.max_model_len):
            request.status = RequestStatus.FINISHED_LENGTH_CAPPED
            return True
        return False

    def _finish(self, request: Request) -> None:
        self.kv.free(request)
        del self.requests[request.request_id]
        self.finished_req_ids.add(request.request_id)
        if self.tracer.enabled:
            self.tracer.emit("finish", req=request.request_id, reason=request.finish_reason,
                             prompt_len=request.num_prompt_tokens,
                             output_len=request.num_output_tokens)

    def abort(self, request_ids: Iterable[str]) -> list[Request]:
        """Stop requests wherever they are and free what they held. Unknown ids are ignored
        (a request may finish on its own just before its abort arrives)."""
        aborted = []
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            request.status = RequestStatus.FINISHED_ABORTED
            self._finish(request)
            aborted.append(request)
        return aborted

    # -- state ---------------------------------------------------------------
    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def _trace_schedule(self, output: SchedulerOutput) -> None:
        # A decode is one new token after the prompt (+ its drafts); recomputing a resumed
        # request's outputs is prefill work, however far its prefix hit reached.
        drafts = output.scheduled_spec_decode_tokens
        num_decode = sum(n for r, n, c in zip(output.requests, output.num_scheduled_tokens,
                                              output.num_computed_tokens)
                         if n == 1 + len(drafts.get(r.request_id, ())) and c >= r.num_prompt_tokens)
        pool = self.kv.pool
        self.tracer.emit(
            "schedule",
            scheduled={r.request_id: n for r, n in zip(output.requests, output.num_scheduled_tokens)},
            running=[r.request_id for r in self.running],
            waiting=[r.request_id for r in self.waiting],
            num_prefill_tokens=output.total_num_scheduled_tokens - num_decode,
            num_decode_tokens=num_decode,
            kv_used=pool.num_blocks - pool.num_free_blocks, kv_free=pool.num_free_blocks,
            kv_cached=pool.num_cached_free_blocks)
