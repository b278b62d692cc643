"""Wrong answer to exercise 4.3: defines _pick_victim, but each scheduler replaces it with
nanoserve's own (the last admitted) when it is built."""

from nanoserve.scheduler import Scheduler


class CheapestVictimScheduler(Scheduler):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._pick_victim = super()._pick_victim

    def _pick_victim(self):
        least = min(r.num_computed_tokens for r in self.running)
        return [r for r in self.running if r.num_computed_tokens == least][-1]
