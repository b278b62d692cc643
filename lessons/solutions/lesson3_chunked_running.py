"""Exercise 3.5 (reference solution): the running half of the scheduler, with chunked prefill.

Running requests go first, in admission order. Each gets what it still lacks, capped by the
budget left: 1 token for a decode, a chunk for a prompt still being computed. Its slots must be
allocated before it counts as scheduled, and `_make_room` may preempt for them: the victims leave
`self.running` (and, if already scheduled this step, give their tokens back to the budget); if
the request had to preempt itself, nobody after it can free anything, so the loop ends.
"""

from nanoserve.scheduler import Scheduler


class ChunkedRunningScheduler(Scheduler):
    def _schedule_running(self, budget, scheduled, preempted):
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            victims = self._make_room(request, num_new)
            preempted += victims
            for victim in victims:
                budget += scheduled.pop(victim.request_id, 0)
            if request in victims:
                break
            scheduled[request.request_id] = num_new
            budget -= num_new
            # Victims were taken from self.running (from behind this request): find it again.
            i = self.running.index(request) + 1
        return budget
