"""Exercise 3.3 (reference solution): a shortest-job-first waiting queue.

The scheduler asks its waiting queue for `peek()` / `pop()` (who is admitted next),
`add(request, front)` (arrivals, and preempted requests with front=True), `remove(request)`
(aborts), `len()` and iteration. Shortest job first admits the request with the fewest
tokens to go, prompt + max_tokens (a real server would predict the output length; here
max_tokens is known). A preempted request simply rejoins: its size decides its place.
"""


def job_size(request) -> tuple[int, float]:
    return (request.num_prompt_tokens + request.max_tokens, request.arrival_time)


class ShortestJobFirstQueue:
    def __init__(self):
        self._requests = []

    def add(self, request, front: bool = False) -> None:
        self._requests.append(request)

    def peek(self):
        return min(self._requests, key=job_size)

    def pop(self):
        request = self.peek()
        self._requests.remove(request)
        return request

    def remove(self, request) -> None:
        self._requests.remove(request)

    def __len__(self) -> int:
        return len(self._requests)

    def __iter__(self):
        return iter(sorted(self._requests, key=job_size))
