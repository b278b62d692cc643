"""Exercise 3.4 (reference solution): static batching, to compare with continuous batching.

A static batcher admits a batch, runs it until every member has finished, and only then
admits the next batch: a seat freed by a short request stays empty until the longest request
of its batch is done. Here that is the real scheduler with its waiting queue hidden while a
batch is in flight.
"""

from nanoserve.scheduler import Scheduler, WaitingQueue


class StaticBatchScheduler(Scheduler):
    def schedule(self):
        if not self.running:
            return super().schedule()          # between batches: admit a new one
        waiting = self.waiting
        self.waiting = WaitingQueue(self.config.scheduling_policy)   # nobody may join
        try:
            return super().schedule()
        finally:
            # A member preempted in this step went to the (hidden) front: keep it in front.
            for request in reversed(list(self.waiting)):
                waiting.add(request, front=True)
            self.waiting = waiting
