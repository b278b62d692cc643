"""Wrong answer to exercise 4.3: costs a request by all the tokens it knows (num_tokens), though
a prompt being computed in chunks has not computed them all: the rest is not lost."""

from nanoserve.scheduler import Scheduler


class CheapestVictimScheduler(Scheduler):
    def _pick_victim(self):
        least = min(r.num_tokens for r in self.running)
        return [r for r in self.running if r.num_tokens == least][-1]
