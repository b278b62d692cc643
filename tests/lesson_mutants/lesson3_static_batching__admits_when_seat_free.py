"""Wrong answer to exercise 3.4: admits only when fewer than max_num_seqs run, which is what
the scheduler already does: continuous batching, not static."""

from nanoserve.scheduler import Scheduler


class StaticBatchScheduler(Scheduler):
    def schedule(self):
        if len(self.running) < self.config.max_num_seqs:
            return super().schedule()
        waiting, self.waiting = self.waiting, type(self.waiting)(self.config.scheduling_policy)
        try:
            return super().schedule()
        finally:
            for request in reversed(list(self.waiting)):
                waiting.add(request, front=True)
            self.waiting = waiting
