"""Wrong answer to exercise 3.3: a job's size taken as its max_tokens alone."""


def job_size(request):
    return (request.max_tokens, request.arrival_time)


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
