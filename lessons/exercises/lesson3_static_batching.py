"""Exercise 3.4: static batching, to compare with continuous batching (lesson 03).

Before continuous batching, servers ran *static* batches: admit up to max_num_seqs requests,
run them until every one has finished, then admit the next batch. Write that policy as a
subclass of nanoserve's Scheduler: while any request of the current batch is running, admit
nobody new (running requests still get their tokens, preemption still works); when none is
running, schedule as usual, which admits the next batch.

Hint: Scheduler.schedule admits from `self.waiting` in its step 2. The check compares the
number of steps with the real (continuous) scheduler on the same requests.
Check: `nanoserve exercise check 3.4`.
"""

from nanoserve.scheduler import Scheduler, WaitingQueue  # noqa: F401


class StaticBatchScheduler(Scheduler):
    def schedule(self):
        raise NotImplementedError(
            "implement StaticBatchScheduler.schedule() in lessons/exercises/"
            "lesson3_static_batching.py: while self.running is not empty, schedule without "
            "admitting anyone from self.waiting; otherwise call super().schedule()")
