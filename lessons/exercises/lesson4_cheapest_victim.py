"""Exercise 4.3: preempt the request that is cheapest to recompute (lesson 04-preemption.md).

When a running request needs a block and the pool is empty, nanoserve's scheduler asks
`self._pick_victim()` whom to preempt, and today that is the last-admitted running request
(`self.running[-1]`). Recompute preemption throws the victim's KV away, so the work lost is
its `num_computed_tokens`. Override `_pick_victim` to return the running request with the
fewest computed tokens; among equals, the one admitted last (latest in `self.running`).

The check runs a workload that preempts, asserts every victim had the fewest computed
tokens, and prints how many tokens each policy computed in all.
Check: `nanoserve exercise check 4.3`.
"""

from nanoserve.scheduler import Scheduler


class CheapestVictimScheduler(Scheduler):
    def _pick_victim(self):
        raise NotImplementedError(
            "implement CheapestVictimScheduler._pick_victim() in lessons/exercises/"
            "lesson4_cheapest_victim.py: return the request in self.running with the fewest "
            "num_computed_tokens (ties: the latest in self.running)")
