"""Wrong answer to exercise 4.3: the request with the fewest *output* tokens, forgetting that
its prompt's K/V are lost too."""

from nanoserve.scheduler import Scheduler


class CheapestVictimScheduler(Scheduler):
    def _pick_victim(self):
        least = min(r.num_output_tokens for r in self.running)
        return [r for r in self.running if r.num_output_tokens == least][-1]
