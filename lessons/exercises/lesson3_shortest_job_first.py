"""Exercise 3.3: a shortest-job-first waiting queue (lesson 03-continuous-batching.md).

The scheduler admits waiting requests through its waiting queue (nanoserve/scheduler.py,
WaitingQueue). Goal: a queue that always offers the *shortest job* waiting: the request
with the fewest tokens in all, `request.num_prompt_tokens + request.max_tokens` (max_tokens
is set when the request is added); among equal sizes, the earliest `request.arrival_time`.
That holds for every request, a preempted one coming back included.

The scheduler calls:
    add(request, front=False)   a new arrival; a preempted request comes back with front=True
    peek() / pop()              the request to admit next (pop also removes it)
    remove(request)             an abort
    len(queue), iter(queue)     how many wait, and who (the trace lists them)

The check installs it with `scheduler.waiting = ShortestJobFirstQueue()`.
Check: `nanoserve exercise check 3.3`.
"""


class ShortestJobFirstQueue:
    def __init__(self):
        self._requests = []

    def add(self, request, front: bool = False) -> None:
        self._requests.append(request)

    def peek(self):
        raise NotImplementedError(
            "implement ShortestJobFirstQueue.peek() and pop() in "
            "lessons/exercises/lesson3_shortest_job_first.py: the shortest job waiting")

    def pop(self):
        raise NotImplementedError("implement ShortestJobFirstQueue.pop(): remove and return "
                                  "the shortest job waiting")

    def remove(self, request) -> None:
        self._requests.remove(request)

    def __len__(self) -> int:
        return len(self._requests)

    def __iter__(self):
        return iter(self._requests)
