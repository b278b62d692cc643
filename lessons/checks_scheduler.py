"""checks_scheduler.py: the checks of the scheduler exercises (3.3, 3.4, 4.3), run by
lessons/checks.py.

They run on tests/fake_engine.py, a model-free engine whose "model" stores every token through
the block tables and reads it back, so a wrong schedule or a wrongly shared block shows up as
a wrong output token. Where an exercise names a rule (an order, a tie-break, whom to evict),
the check wraps the learner's method and compares every decision it makes with the rule,
under memory pressure as well: preemption is where scheduling code goes wrong. Every check runs
the learner's code under check_kit.own_work, at blocks of 4 and of 16 tokens.
"""

from __future__ import annotations

from contextlib import nullcontext

from check_kit import expect, fake_engine, oracle, own_work


# -- 3.3 shortest job first; 3.4 static batching ------------------------------------------------
def scheduler_of(cls, num_blocks=128, block_size=4, max_model_len=128, **config):
    from nanoserve.config import Config
    from nanoserve.kv_cache import KVCacheManager
    cfg = Config(block_size=block_size, max_model_len=max_model_len, num_kv_blocks=num_blocks,
                 **config)
    return cls(cfg, KVCacheManager(num_blocks, block_size, cfg.enable_prefix_caching))


def run_checked(fake, sched, spec):
    """Run (id, prompt, max_tokens) requests on the fake engine; the outputs must be the
    reference tokens and the KV invariants must hold after every step."""
    requests = [fake.make_request(*s) for s in spec]
    outs, steps = fake.run(sched, requests, check=lambda s: s.kv.check_invariants())
    for rid, prompt, max_tokens in spec:
        expect(outs[rid] == fake.reference_tokens(prompt, max_tokens),
               f"request {rid} produced the wrong tokens: a block was shared, freed or reused "
               "wrongly")
    expect(sched.kv.pool.num_free_blocks == sched.kv.num_blocks,
           "blocks leaked: not all free at the end")
    return requests, steps


def first_and_last_steps(steps) -> tuple[dict[str, int], dict[str, int]]:
    first, last = {}, {}
    for i, out in enumerate(steps, 1):
        for r in out.requests:
            first.setdefault(r.request_id, i)
            last[r.request_id] = i
    return first, last


def job_key(request) -> tuple[int, float]:
    return request.num_prompt_tokens + request.max_tokens, request.arrival_time


def shortest_first(queue):
    """Wrap the queue's peek and pop: each must return the shortest job waiting (ties: the
    earliest arrival), whatever order requests were added in (preempted ones come back later)."""
    def checked(inner):
        def call():
            waiting = list(queue)
            expect(len(waiting) == len(queue), "iter(queue) must list every waiting request")
            want = min(waiting, key=job_key)
            got = inner()
            tie = ", the same, but it arrived earlier" if job_key(got)[0] == job_key(want)[0] else ""
            expect(got is want, f"the queue gave {got.request_id} (size {job_key(got)[0]}) "
                   f"while {want.request_id} (size {job_key(want)[0]}{tie}) was waiting")
            return got
        return call
    queue.peek, queue.pop = checked(queue.peek), checked(queue.pop)
    return queue


def check_shortest_job_first(mod, say) -> None:
    from nanoserve.scheduler import Scheduler, WaitingQueue
    fake = fake_engine()
    methods = [f"ShortestJobFirstQueue.{m}" for m in
               ("add", "peek", "pop", "remove", "__len__", "__iter__")]
    with own_work(mod, methods, [WaitingQueue.add, WaitingQueue.peek, WaitingQueue.pop],
                  "keep the waiting requests yourself"):
        sjf_one_seat(fake, mod, say)
        # Pools so small that requests are preempted and come back with add(front=True): every
        # admission must still be the shortest job waiting. Blocks of 4 tokens, then of 16.
        for block_size, num_blocks in ((4, 12), (16, 5)):
            sched = scheduler_of(Scheduler, num_blocks=num_blocks, block_size=block_size)
            sched.waiting = shortest_first(mod.ShortestJobFirstQueue())
            run_checked(fake, sched, SJF_SPEC)
            expect(sched.num_preemptions_total > 0, "the pool should have preempted (check bug)")
        for block_size, num_blocks in ((4, 16), (16, 5)):
            sjf_after_preemption(fake, mod, block_size, num_blocks)
        say("blocks of 4 and 16, pools that preempt: every admission the shortest job waiting, "
            "a preempted one included (its outputs are computed again: it is no shorter); "
            "every token right")
        sched = scheduler_of(Scheduler)
        sched.waiting = mod.ShortestJobFirstQueue()
        for s in SJF_SPEC:
            sched.add_request(fake.make_request(*s))
        sched.abort(["r2"])
        expect(len(sched.waiting) == len(SJF_SPEC) - 1 and
               all(r.request_id != "r2" for r in sched.waiting),
               "an aborted waiting request must leave the queue (remove)")
        say("abort removes a waiting request")


# (id, prompt, max_tokens): job sizes 30, 9, 22, 5, 14, 40, 24, all waiting at step 1. Ordered
# by prompt, by max_tokens and by their sum, they give three different orders.
SJF_SPEC = [(f"r{i}", [i + 1] * p, m) for i, (p, m) in
            enumerate([(10, 20), (3, 6), (12, 10), (2, 3), (6, 8), (15, 25), (20, 4)])]


def sjf_one_seat(fake, mod, say) -> None:
    from nanoserve.scheduler import Scheduler
    order = sorted(SJF_SPEC, key=lambda s: len(s[1]) + s[2])
    mean = {}
    for name, make_queue in (("FCFS", None), ("SJF", mod.ShortestJobFirstQueue)):
        sched = scheduler_of(Scheduler, max_num_seqs=1)
        if make_queue:
            sched.waiting = make_queue()
        with oracle() if make_queue is None else nullcontext():
            _, steps = run_checked(fake, sched, SJF_SPEC)
        first, last = first_and_last_steps(steps)
        mean[name] = sum(last.values()) / len(last)
    admitted = sorted(first, key=first.get)
    expect(admitted == [s[0] for s in order], f"one seat (max_num_seqs 1): requests must run "
           f"shortest first, {[s[0] for s in order]} (got {admitted})")
    say(f"one seat: admitted shortest first {admitted}; mean finish step SJF {mean['SJF']:.1f} "
        f"vs FCFS {mean['FCFS']:.1f}")
    expect(mean["SJF"] < mean["FCFS"], "SJF must finish requests sooner on average than FCFS")
    # Equal sizes, added in the opposite order of their arrival: the earliest arrival goes first.
    queue = mod.ShortestJobFirstQueue()
    tied = [fake.make_request(f"t{i}", [1] * 4, 4) for i in range(3)]
    for i, request in enumerate(tied):
        request.arrival_time = 100.0 - i
    for request in tied:
        queue.add(request)
    expect(queue.peek() is tied[2] and queue.pop() is tied[2] and queue.pop() is tied[1],
           "equal job sizes: the request that arrived first must go first (arrival_time), "
           "whatever order they were added in")
    say("equal sizes go by arrival_time, not by the order they were added")


def sjf_after_preemption(fake, mod, block_size, num_blocks) -> None:
    """Two jobs of 44 tokens fill the pool; the later one is preempted with 28 outputs, and a
    job of 20 tokens arrives then. The preempted job has lost its outputs with its blocks: it
    is still a job of 44 tokens, and the new one goes first (and fits)."""
    from nanoserve.scheduler import Scheduler
    sched = scheduler_of(Scheduler, num_blocks=num_blocks, block_size=block_size)
    sched.waiting = shortest_first(mod.ShortestJobFirstQueue())
    late, arrived = fake.make_request("late", [9] * 10, 10), []

    def arrive(s):
        s.kv.check_invariants()
        if s.num_preemptions_total and not arrived:
            arrived.append(s.add_request(late))
    fake.run(sched, [fake.make_request(f"long{i}", [i + 1] * 4, 40) for i in range(2)],
             check=arrive)
    expect(sched.num_preemptions_total > 0, "the small pool should have preempted (check bug)")
    expect(late.output_token_ids == fake.reference_tokens([9] * 10, 10),
           "request late produced the wrong tokens")


def one_batch_at_a_time(sched) -> None:
    """Wrap schedule(): nobody is admitted while a batch runs, and a member preempted during
    its batch is admitted again before any request that never ran."""
    schedule, started = sched.schedule, set()

    def checked():
        before = {r.request_id for r in sched.running}
        out = schedule()
        admitted = [r.request_id for r in out.requests if r.request_id not in before]
        expect(not before or not admitted, f"{admitted} joined while {sorted(before)} were still "
               "running: a static batch admits nobody until every member has finished")
        behind = [r.request_id for r in sched.waiting if r.request_id in started]
        expect(not behind or all(a in started for a in admitted), f"{behind} was preempted from "
               f"its batch, yet {[a for a in admitted if a not in started]} (never run) went first")
        started.update(admitted)
        queued = {r.request_id for r in sched.running} | {r.request_id for r in sched.waiting}
        lost = sorted(set(sched.requests) - queued)
        expect(not lost, f"{lost} neither running nor waiting: a preempted member was lost")
        return out
    sched.schedule = checked


def check_static_batching(mod, say) -> None:
    from nanoserve.scheduler import Scheduler
    fake = fake_engine()
    spec = [(f"r{i}", [i + 1] * 6, 4 if i % 2 else 32) for i in range(8)]
    continuous = scheduler_of(Scheduler, max_num_seqs=4)
    _, cont_steps = run_checked(fake, continuous, spec)
    with own_work(mod, ["StaticBatchScheduler.schedule"]):
        static = scheduler_of(mod.StaticBatchScheduler, max_num_seqs=4)
        one_batch_at_a_time(static)
        _, steps = run_checked(fake, static, spec)
        first, _ = first_and_last_steps(steps)
        expect(len(set(first.values())) > 1, "no request waited: every request ran in one batch?")
        say(f"no request joins a running batch; {len(set(first.values()))} batches")
        expect(len(steps) > len(cont_steps), "static batching should need more steps than "
               "continuous")
        say(f"8 requests of 4 or 32 tokens, 4 seats: {len(steps)} steps static vs "
            f"{len(cont_steps)} continuous")
        # Pools too small for a whole batch: members are preempted while their batch runs.
        for block_size, num_blocks in ((4, 16), (16, 5)):
            static = scheduler_of(mod.StaticBatchScheduler, max_num_seqs=4,
                                  num_blocks=num_blocks, block_size=block_size)
            one_batch_at_a_time(static)
            run_checked(fake, static, spec)
            expect(static.num_preemptions_total > 0, "the pool should have preempted (check bug)")
    say("16 blocks of 4, 5 blocks of 16: members preempted, each resumed before any new "
        "request; every token right, no block leaked")


# -- 4.3 cheapest victim -----------------------------------------------------------------------
def check_cheapest_victim(mod, say) -> None:
    from nanoserve.scheduler import Scheduler
    computed = {}
    with own_work(mod, ["CheapestVictimScheduler._pick_victim"], [Scheduler._pick_victim],
                  "choose the victim yourself"):
        for block_size, num_blocks in ((4, 14), (16, 4)):
            with oracle():
                last = victims_in_a_run(Scheduler, block_size, num_blocks)
            computed[block_size] = (last, victims_in_a_run(mod.CheapestVictimScheduler,
                                                           block_size, num_blocks))
        say("14 blocks of 4, 4 blocks of 16: every victim had the fewest computed tokens (not "
            "always the last admitted); every token right")
        # Mid-step, as in schedule(): a request may already hold blocks for tokens not yet
        # computed, so blocks held (or tokens known) are not the cost.
        for running, want, rule in (
                ([("a", 4, 12), ("b", 6, 6)], "a", "fewest computed tokens, not fewest blocks"),
                ([("p", 7, 7), ("q", 5, 5), ("r", 5, 5), ("s", 9, 9)], "r",
                 "among equals, the latest in self.running")):
            victim = pick_mid_step(mod.CheapestVictimScheduler, running)
            expect(victim.request_id == want, f"running {[(r, c) for r, c, _ in running]} "
                   f"(id, computed tokens): the victim is {want} ({rule}), not "
                   f"{victim.request_id}")
    say("ties go to the latest admitted; cost is computed tokens, not blocks held")
    say("tokens computed in all, recomputation included, last admitted vs cheapest: "
        + ", ".join(f"{a} vs {b} in blocks of {size}" for size, (a, b) in computed.items()))


def victims_in_a_run(cls, block_size, num_blocks) -> int:
    """Short prompts admitted first, long ones last: the default victim is the costly one. Each
    victim must have the fewest computed tokens; returns the tokens computed in all."""
    from nanoserve.scheduler import Scheduler
    spec = [(f"r{i}", [i + 1] * p, m) for i, (p, m) in
            enumerate([(2, 24), (3, 24), (2, 24), (30, 8), (28, 8)])]
    sched = scheduler_of(cls, num_blocks=num_blocks, block_size=block_size)
    pick, not_last = sched._pick_victim, []

    def checked():
        victim = pick()
        least = min(r.num_computed_tokens for r in sched.running)
        expect(victim in sched.running and victim.num_computed_tokens == least,
               f"victim {victim.request_id} has {victim.num_computed_tokens} computed tokens; a "
               f"running request has only {least}")
        not_last.append(victim is not sched.running[-1])
        return victim
    if cls is not Scheduler:
        sched._pick_victim = checked
    _, steps = run_checked(fake_engine(), sched, spec)
    expect(cls is Scheduler or any(not_last), f"blocks of {block_size}: every victim was the "
           "last admitted: the cheapest is not always last (check bug)")
    return sum(out.total_num_scheduled_tokens for out in steps)


def pick_mid_step(cls, running):
    """The victim cls picks among `running`: (id, computed tokens, tokens allocated)."""
    fake = fake_engine()
    sched = scheduler_of(cls)
    for rid, num_computed, allocated in running:
        request = fake.make_request(rid, list(range(1, allocated + 1)), 4)
        sched.add_request(request)
        sched.waiting.remove(request)
        sched.kv.allocate_slots(request, allocated)
        request.num_computed_tokens = num_computed
        sched.running.append(request)
    return sched._pick_victim()
