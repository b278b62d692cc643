"""Wrong answer to exercise 3.4: hides the waiting queue while a batch runs, but forgets the
members preempted meanwhile (they went into the hidden queue)."""

from nanoserve.scheduler import Scheduler, WaitingQueue


class StaticBatchScheduler(Scheduler):
    def schedule(self):
        if not self.running:
            return super().schedule()
        waiting = self.waiting
        self.waiting = WaitingQueue(self.config.scheduling_policy)
        out = super().schedule()
        self.waiting = waiting
        return out
