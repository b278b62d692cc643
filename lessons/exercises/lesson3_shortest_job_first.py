"""Exercise 3.3: a shortest-job-first waiting queue (lesson 03-continuous-batching.md).

The scheduler admits waiting requests through its waiting queue (nanoserve/scheduler.py,
WaitingQueue: first come, first served). Goal: a queue that always offers the smallest job
waiting. A job's size is the tokens it holds when it ends at its limit: its prompt and its
max_tokens (set on the request before the scheduler adds it). Equal sizes go by arrival, the
request that arrived first (its arrival_time) first. A preempted request comes back to the
queue: it is still the same job, and takes its place by the same rule.

Interface, what the scheduler calls:
    add(request, front=False)   a new arrival; a preempted request comes back with front=True
    peek()                      the request to admit next, left in the queue
    pop()                       the same, removed from the queue
    remove(request)             an abort
    len(queue), iter(queue)     how many wait, and who (the trace lists them)

The check installs it with `scheduler.waiting = ShortestJobFirstQueue()`, on the model-free
engine: one seat, then pools so small that requests are preempted and come back (a request
preempted after many outputs among them), with blocks of 4 and of 16 tokens.
Check: `nanoserve exercise check 3.3`.
"""


class ShortestJobFirstQueue:
    def add(self, request, front: bool = False) -> None:
        raise NotImplementedError(
            "implement ShortestJobFirstQueue in lessons/exercises/lesson3_shortest_job_first.py:"
            " add, peek, pop, remove, __len__ and __iter__")

    def peek(self):
        raise NotImplementedError("implement ShortestJobFirstQueue.peek()")

    def pop(self):
        raise NotImplementedError("implement ShortestJobFirstQueue.pop()")

    def remove(self, request) -> None:
        raise NotImplementedError("implement ShortestJobFirstQueue.remove()")

    def __len__(self) -> int:
        raise NotImplementedError("implement ShortestJobFirstQueue.__len__()")

    def __iter__(self):
        raise NotImplementedError("implement ShortestJobFirstQueue.__iter__()")
