"""Exercise 3.4: static batching, to compare with continuous batching (lesson 03).

Before continuous batching, servers ran *static* batches: admit up to max_num_seqs requests,
run them until every one has finished, then admit the next batch. Goal: that policy, as a
subclass of nanoserve's Scheduler. While a batch runs, nobody new is admitted; its members
still get their tokens, and preemption still works: a member preempted during its batch
goes back to the front of the waiting queue, as in the real scheduler, and is admitted
before any request that never ran.

Interface: the same as Scheduler's (nanoserve/scheduler.py): `schedule()` returns the step's
SchedulerOutput; `self.running`, `self.waiting` (a WaitingQueue) and `self.config` are there
to use. The check runs it beside the real (continuous) scheduler on the same requests, with
a pool big enough for a whole batch and with ones that are not (blocks of 4 and of 16 tokens).
Check: `nanoserve exercise check 3.4`.
"""

from nanoserve.scheduler import Scheduler, WaitingQueue  # noqa: F401


class StaticBatchScheduler(Scheduler):
    def schedule(self):
        raise NotImplementedError(
            "implement StaticBatchScheduler.schedule() in lessons/exercises/"
            "lesson3_static_batching.py: one batch at a time, nobody admitted while it runs")
