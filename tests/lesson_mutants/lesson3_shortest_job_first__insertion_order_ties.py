"""Wrong answer to exercise 3.3: equal sizes go in the order they were added, not by arrival time
(a preempted request is added again long after it arrived)."""


def job_size(request):
    return request.num_prompt_tokens + request.max_tokens


class ShortestJobFirstQueue:
    def __init__(self):
        self._requests = []

    def add(self, request, front=False):
        self._requests.append(request)

    def peek(self):
        return min(self._requests, key=job_size)

    def pop(self):
        request = self.peek()
        self._requests.remove(request)
        return request

    def remove(self, request):
        self._requests.remove(request)

    def __len__(self):
        return len(self._requests)

    def __iter__(self):
        return iter(sorted(self._requests, key=job_size))
