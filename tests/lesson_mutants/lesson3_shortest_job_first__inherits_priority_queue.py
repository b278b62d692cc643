"""Wrong answer to exercise 3.3: hands the ordering to nanoserve's priority queue, a job's size
written into its priority; peek, pop and the rest are inherited, not written."""

from nanoserve.scheduler import WaitingQueue


class ShortestJobFirstQueue(WaitingQueue):
    def __init__(self):
        super().__init__("priority")

    def add(self, request, front: bool = False) -> None:
        request.priority = request.num_prompt_tokens + request.max_tokens
        super().add(request)
