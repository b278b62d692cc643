"""Exercise 3.5: the running half of the scheduler, with chunked prefill (lesson 03).

nanoserve's `Scheduler.schedule()` gives this step's tokens to the running requests first
(`_schedule_running`), then admits waiting ones with what is left. Goal: write the first half.
Every running request, in admission order, gets the tokens it still lacks, as far as the
step's token budget goes (a prompt that does not fit is computed in chunks over several steps);
no request gets tokens without its KV slots, and when slots run out, requests are preempted as
nanoserve preempts them. The check compares every step your scheduler makes with nanoserve's.

Interface (nanoserve/scheduler.py, Scheduler):
    _schedule_running(self, budget, scheduled, preempted) -> int
        budget     the step's token budget (max_num_batched_tokens)
        scheduled  dict, request id -> tokens this step: fill it, in the order they run
        preempted  list: append every request preempted in this step
        returns    the budget left for the waiting requests
What you may call: self.running (a list, admission order), request.num_tokens,
request.num_computed_tokens, and self._make_room(request, num_new_tokens), which allocates the
request's slots, preempting running requests (the request itself last) until they fit, and
returns the preempted ones (each already out of self.running).

The check runs your scheduler on the model-free engine beside nanoserve's (requests arriving over
the first steps, under the `fcfs` and the `priority` policy: there a victim may be a request
scheduled earlier in the same step; blocks of 4 and of 16 tokens), and then inside the real
engine, with a pool that preempts and a budget that chunks, against HF's greedy tokens.
Check: `nanoserve exercise check 3.5`.
"""

from nanoserve.scheduler import Scheduler


class ChunkedRunningScheduler(Scheduler):
    def _schedule_running(self, budget, scheduled, preempted):
        raise NotImplementedError(
            "implement ChunkedRunningScheduler._schedule_running in lessons/exercises/"
            "lesson3_chunked_running.py: the running requests' tokens for this step")
