"""Exercise 4.3: preempt the request that is cheapest to recompute (lesson 04-preemption.md).

When a running request needs a block and the pool is empty, nanoserve's scheduler asks
`self._pick_victim()` whom to preempt, and today that is the last-admitted running request
(`self.running[-1]`). Recompute preemption throws the victim's KV away, so the work lost is
its `num_computed_tokens`. Goal: `_pick_victim` returns the running request whose
preemption loses the least work; among equals, the one admitted last (latest in
`self.running`). It only chooses: the scheduler removes and preempts the request it returns.

The check runs a workload that preempts, asserts every victim had the fewest computed
tokens, and prints how many tokens each policy computed in all.
Check: `nanoserve exercise check 4.3`.
"""

from nanoserve.scheduler import Scheduler


class CheapestVictimScheduler(Scheduler):
    def _pick_victim(self):
        raise NotImplementedError(
            "implement CheapestVictimScheduler._pick_victim() in lessons/exercises/"
            "lesson4_cheapest_victim.py: the running request cheapest to recompute")
