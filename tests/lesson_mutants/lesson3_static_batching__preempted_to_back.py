"""Wrong answer to exercise 3.4: members preempted during a batch go to the back of the
waiting queue, so they lose their turn to requests that arrived after them."""

from nanoserve.scheduler import Scheduler, WaitingQueue


class StaticBatchScheduler(Scheduler):
    def schedule(self):
        if not self.running:
            return super().schedule()
        waiting = self.waiting
        self.waiting = WaitingQueue(self.config.scheduling_policy)
        try:
            return super().schedule()
        finally:
            for request in self.waiting:
                waiting.add(request)
            self.waiting = waiting
