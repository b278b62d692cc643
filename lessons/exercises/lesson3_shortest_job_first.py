"""Exercise 3.3: a shortest-job-first waiting queue (lesson 03-continuous-batching.md).

The scheduler admits waiting requests through its waiting queue (nanoserve/scheduler.py,
WaitingQueue). Write a queue that admits the *shortest job* first: the waiting request with
the fewest tokens to go, `request.num_prompt_tokens + request.max_tokens` (max_tokens is set
when the request is added); among equals, the earliest `request.arrival_time`.

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
            "lessons/exercises/lesson3_shortest_job_first.py: return the waiting request with "
            "the smallest num_prompt_tokens + max_tokens (ties: earliest arrival_time)")

    def pop(self):
        raise NotImplementedError("implement ShortestJobFirstQueue.pop(): remove and return "
                                  "what peek() returns")

    def remove(self, request) -> None:
        self._requests.remove(request)

    def __len__(self) -> int:
        return len(self._requests)

    def __iter__(self):
        return iter(self._requests)
