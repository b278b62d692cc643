"""Exercise 4.3 (reference solution): preempt the request that is cheapest to recompute.

nanoserve (like vLLM) preempts the last-admitted running request. Recompute preemption
throws away the victim's KV, so the work lost is its num_computed_tokens: picking the running
request with the fewest loses the least. Among equals, the last admitted goes, as before.
"""

from nanoserve.scheduler import Scheduler


class CheapestVictimScheduler(Scheduler):
    def _pick_victim(self):
        least = min(r.num_computed_tokens for r in self.running)
        return [r for r in self.running if r.num_computed_tokens == least][-1]
