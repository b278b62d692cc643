"""Exercise 4.3: preempt the request that is cheapest to recompute (lesson 04-preemption.md).

When a running request needs a block and the pool is empty, nanoserve's scheduler asks
`self._pick_victim()` whom to preempt; today that is the last-admitted running request.
Goal: preempt the running request whose preemption costs the least work when it resumes
(lesson 4: what does recompute preemption throw away, and what must be computed again?);
among equal costs, the one admitted last (latest in `self.running`). It only chooses: the
scheduler removes and preempts the request it returns.

The cost model the check uses: a victim's cost is the number of tokens whose K/V it had
computed, prompt and outputs alike, `request.num_computed_tokens`: recompute preemption throws
them away and computes them again. Blocks it holds for tokens not computed yet cost nothing.

Interface: `_pick_victim(self) -> Request`, one of `self.running` (admission order). A
Request (nanoserve/request.py) knows its tokens and its progress; the KV cache manager
(`self.kv`) knows its blocks.

The check runs a workload that preempts on the model-free engine, with blocks of 4 and of 16
tokens, checks every victim, and prints how many tokens each policy computed in all.
Check: `nanoserve exercise check 4.3`.
"""

from nanoserve.scheduler import Scheduler


class CheapestVictimScheduler(Scheduler):
    def _pick_victim(self):
        raise NotImplementedError(
            "implement CheapestVictimScheduler._pick_victim() in lessons/exercises/"
            "lesson4_cheapest_victim.py: the running request cheapest to recompute")
