"""Wrong answer to exercise 3.3: a preempted request (front=True) is admitted next whatever
its size, as in the FCFS queue; the rest is shortest first."""


def job_size(request):
    return (request.num_prompt_tokens + request.max_tokens, request.arrival_time)


class ShortestJobFirstQueue:
    def __init__(self):
        self._front = []
        self._requests = []

    def add(self, request, front=False):
        if front:
            self._front.insert(0, request)
        else:
            self._requests.append(request)

    def peek(self):
        return self._front[0] if self._front else min(self._requests, key=job_size)

    def pop(self):
        request = self.peek()
        (self._front if self._front and request is self._front[0] else self._requests).remove(request)
        return request

    def remove(self, request):
        (self._front if request in self._front else self._requests).remove(request)

    def __len__(self):
        return len(self._front) + len(self._requests)

    def __iter__(self):
        return iter(self._front + sorted(self._requests, key=job_size))
