"""checks_engine.py: the checks of the build-the-mechanism exercises 2.4, 3.5, 7.4 and 9.3, run by
lessons/checks.py (4.4 and 5.4, the KV cache's, are in checks_cache.py).

Each exercise writes one piece of the engine itself: the flat batch's indices, the running half of
the scheduler, the sampler's exponential race, a mixture of experts' router (on tiny random MoE
checkpoints, lessons/moe_checkpoint.py). The
check swaps the learner's piece into the real engine, through the same public attributes that
lessons/workload.py uses (`engine.scheduler`, `engine.kv_cache_manager`, and the model runner's
`sampler` and `batch_indices`: `engine.executor.model_runner`), and asks for HF transformers'
greedy tokens, in a pool so small that requests are preempted and with a budget so small that
prompts are chunked. Where a rule can be stated (the budget, a seeded row's independence), the
check holds every call to it as well, so that a wrong piece fails with a message about the call
that went wrong; and the learner's code runs under check_kit.own_work, so that it does the work.
"""

from __future__ import annotations

import random
from contextlib import nullcontext

from check_kit import (aten_ops, expect, expect_hf_greedy, fake_engine, oracle, own_work,
                       prompt_ids, small_llm)
from checks_scheduler import scheduler_of


# -- 2.4 the flat batch: positions, slot_mapping, query_start_loc -----------------------------
def check_batch_indices(mod, say) -> None:
    import torch

    from nanoserve import model_runner
    names = ("positions", "slot_mapping", "query_start_loc")
    calls = 0

    def checked(num_scheduled, num_computed, block_tables, block_size):
        nonlocal calls
        args = (num_scheduled, num_computed, block_tables, block_size)
        got = mod.batch_indices(*(a.clone() if torch.is_tensor(a) else a for a in args))
        with oracle():
            want = model_runner.batch_indices(*args)
        expect(isinstance(got, tuple) and len(got) == 3, "return (positions, slot_mapping, "
               "query_start_loc)")
        for name, g, w in zip(names, got, want):
            expect(torch.is_tensor(g) and g.dtype == torch.int64 and torch.equal(g, w),
                   f"num_scheduled {num_scheduled.tolist()}, num_computed "
                   f"{num_computed.tolist()}, block_tables {block_tables.tolist()}, block_size "
                   f"{block_size}: your {name} is {g.tolist() if torch.is_tensor(g) else g}, "
                   f"it should be {w.tolist()} (int64)")
        calls += 1
        return got
    with own_work(mod, ["batch_indices"], [model_runner.batch_indices]):
        checked(torch.tensor([1, 3]), torch.tensor([9, 0]),
                torch.tensor([[7, 1, 3], [5, 0, 0]], dtype=torch.int32), 4)
        say("the module docstring's example: a decode at position 9 and a 3-token prefill")
        gen = torch.Generator().manual_seed(0)
        for block_size in (8, 16, 32):
            num_computed = torch.randint(0, 3 * block_size, (5,), generator=gen)
            num_scheduled = torch.randint(1, 2 * block_size, (5,), generator=gen)
            tables = torch.randperm(64, generator=gen)[:5 * 6].view(5, 6).int()
            checked(num_scheduled, num_computed, tables, block_size)
        say("5 requests mid-prompt, blocks of 8, 16 and 32 tokens: nanoserve's indices")
        for overrides in ({}, dict(block_size=16, num_kv_blocks=4)):
            llm = small_llm(**overrides)
            llm.engine.executor.model_runner.batch_indices = checked
            expect_hf_greedy(llm, prompt_ids(llm))
            expect(llm.engine.scheduler.num_preemptions_total > 0, "no preemption (check bug)")
    say(f"4 prompts, chunked and preempted, blocks of 4 and 16, {calls} steps with your indices: "
        "HF's greedy tokens")


# -- 3.5 the running half of the scheduler ------------------------------------------------------
def steps_of(outputs) -> list[tuple]:
    return [([(r.request_id, n) for r, n in zip(o.requests, o.num_scheduled_tokens)],
             o.preempted_req_ids) for o in outputs]


def running_contract(sched) -> None:
    """Wrap _schedule_running: only running requests get tokens, within the budget, and the
    budget returned is what is left."""
    inner = sched._schedule_running

    def checked(budget, scheduled, preempted):
        left = inner(budget, scheduled, preempted)
        running = {r.request_id for r in sched.running}
        gone = [rid for rid in scheduled if rid not in running]
        expect(not gone, f"{gone} got tokens but is not running (preempted?): a request that "
               "was preempted, itself included, must leave `scheduled`")
        used = sum(scheduled.values())
        expect(used <= budget and left == budget - used, f"budget {budget}: you scheduled {used} "
               f"tokens and returned {left} as left")
        return left
    sched._schedule_running = checked


def check_schedule_running(mod, say) -> None:
    from nanoserve.scheduler import Scheduler
    with own_work(mod, ["ChunkedRunningScheduler._schedule_running"],
                  [Scheduler._schedule_running], "schedule the running requests yourself"):
        # Under `priority` the victim is the least important request, maybe one scheduled
        # already this step: its tokens go back to the budget, and the loop's place moves.
        for policy, block_size, num_blocks in (("fcfs", 4, 20), ("priority", 4, 20),
                                               ("priority", 16, 5), ("fcfs", 16, 5)):
            same_steps(mod, policy, block_size, num_blocks)
        say("10 requests arriving over 5 steps, budget 16, FCFS and priority, blocks of 4 and 16: "
            "every step as nanoserve's, preempted along the way, every token right")
        llm = small_llm()
        core = llm.engine
        core.scheduler = mod.ChunkedRunningScheduler(core.config, core.kv_cache_manager,
                                                     core.tracer)
        running_contract(core.scheduler)
        expect_hf_greedy(llm, prompt_ids(llm))
        expect(core.scheduler.num_preemptions_total > 0, "no preemption (check bug)")
    say("in the real engine, chunked and preempted: HF's greedy tokens")


def same_steps(mod, policy, block_size, num_blocks, seed=2):
    """Short prompts and long ones (longer than the budget), with random priorities, arriving
    over the first steps, on the fake engine: the learner's scheduler makes every step
    nanoserve's makes."""
    from nanoserve.scheduler import Scheduler
    fake = fake_engine()
    rng = random.Random(seed)
    spec = [(f"r{i}", [rng.randrange(1, 50) for _ in range(
        rng.choice([rng.randint(2, 8), rng.randint(20, 40)]))], rng.randint(4, 20))
        for i in range(10)]
    arrival = {rid: rng.randrange(1, 6) for rid, _, _ in spec[1:]}     # r0 is there at once
    priority = {rid: rng.randrange(4) for rid, _, _ in spec}
    runs = {}
    for name, cls in (("nanoserve", Scheduler), ("yours", mod.ChunkedRunningScheduler)):
        sched = scheduler_of(cls, num_blocks=num_blocks, block_size=block_size,
                             max_num_batched_tokens=16, scheduling_policy=policy)
        if cls is not Scheduler:
            running_contract(sched)
        requests = [fake.make_request(*s) for s in spec]
        for r in requests:
            r.priority = priority[r.request_id]

        def arrive(s):
            s.kv.check_invariants()
            for r in requests:
                if arrival.get(r.request_id) == s.num_steps:
                    s.add_request(r)
        with oracle() if cls is Scheduler else nullcontext():
            _, steps = fake.run(sched, requests[:1], check=arrive)
        for r, (rid, prompt, max_tokens) in zip(requests, spec):
            expect(r.output_token_ids == fake.reference_tokens(prompt, max_tokens),
                   f"{policy}, blocks of {block_size}: request {rid} produced the wrong tokens")
        runs[name] = (steps_of(steps), sched.num_preemptions_total)
    expect(runs["nanoserve"][1] > 0, "no preemption (check bug)")
    for i, (want, got) in enumerate(zip(*[runs[k][0] for k in ("nanoserve", "yours")]), 1):
        expect(want == got, f"{policy}, blocks of {block_size}, step {i}: nanoserve schedules "
               f"{want[0]} (preempted {want[1]}); yours {got[0]} (preempted {got[1]})")
    expect(len(runs["yours"][0]) == len(runs["nanoserve"][0]), "a different number of steps")
    return runs["yours"]


# -- 7.4 the exponential race ---------------------------------------------------------------------
def check_exponential_race(mod, say) -> None:
    import torch

    from nanoserve import SamplingParams
    from nanoserve.sampler import Sampler
    with own_work(mod, ["ExponentialRaceSampler._sample"], [Sampler._sample],
                  "draw each row's noise yourself"):
        sampler = mod.ExponentialRaceSampler(torch.Generator().manual_seed(0))
        with aten_ops() as ops:
            expect_softmax_frequencies(sampler, say)
            expect_seeded_rows(sampler, say)
        expect("multinomial" not in ops, "your code called torch.multinomial: draw each row's "
               "noise yourself")
        llm = small_llm()
        runner = llm.engine.executor.model_runner
        runner.sampler = mod.ExponentialRaceSampler(runner.sampler.generator,
                                                    runner.sampler.argmax)
        prompt = prompt_ids(llm)[0]
        seeded = SamplingParams(temperature=0.8, seed=3, max_tokens=12, ignore_eos=True)
        alone = llm.generate({"prompt_token_ids": prompt}, seeded, progress=False)[0]
        mixed = llm.generate([{"prompt_token_ids": p} for p in prompt_ids(llm)[1:]] +
                             [{"prompt_token_ids": prompt}],
                             [SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)] * 3
                             + [seeded], progress=False)[-1]
        expect(alone.outputs[0].token_ids == mixed.outputs[0].token_ids, "seed 3: different "
               "tokens alone and in a batch of four")
        expect_hf_greedy(llm, prompt_ids(llm)[:2], 12)
    say("in the real engine: a seeded request repeats in a mixed batch; greedy rows are HF's")


def expect_softmax_frequencies(sampler, say) -> None:
    """4000 draws in one call, then 4000 more over 200 calls, follow the softmax; and the
    batch's generator goes on from call to call (no draw repeats a call before it)."""
    import torch
    logits = torch.tensor([[2.0, 1.0, 0.0, float("-inf"), -1.0]] * 4000)
    probs = logits[0].softmax(-1)
    tokens = sampler._sample(logits.clone(), {})
    expect(tokens.shape == (4000,) and tokens.dtype == torch.int64, "return one int64 token id "
           f"per row (got {tuple(tokens.shape)}, {tokens.dtype})")
    again = sampler._sample(logits.clone(), {})
    expect(not torch.equal(tokens, again), "two calls on the same 4000 rows drew the very same "
           "tokens: the rows without a seed draw fresh noise from self.generator at every call "
           "(not re-seeded, not kept from an earlier call)")
    small = torch.cat([sampler._sample(logits[:20].clone(), {}) for _ in range(200)])
    for draws, how in ((tokens, "in one call"), (small, "over 200 calls of 20 rows")):
        freq = torch.bincount(draws, minlength=5).float() / len(draws)
        expect(freq[3] == 0, "a token whose logit is -inf was drawn")
        expect((freq - probs).abs().max() < 0.03, f"4000 draws {how}: frequencies "
               f"{freq.tolist()}, the softmax is {probs.tolist()}: token i must win with "
               "probability p_i")
    say("4000 draws in one call and 4000 over 200 calls follow the softmax within 0.03; "
        "no call repeats the one before")


def expect_seeded_rows(sampler, say) -> None:
    """Seeded rows draw from their own generators alone: the same tokens alone and anywhere in
    a batch, two seeded rows in one batch included, call after call (a generator goes on)."""
    import torch
    gen = torch.Generator().manual_seed(1)
    rows = torch.randn(2, 50, generator=gen)
    seeds = {"row 0": 7, "row 1": 8}

    def draws(place):
        gens = [torch.Generator().manual_seed(s) for s in seeds.values()]
        out = []
        for _ in range(30):
            batch = torch.randn(5, 50, generator=gen)
            batch[list(place)] = rows
            tokens = sampler._sample(batch, dict(zip(place, gens)))
            out.append(tokens[list(place)].tolist())
        return out
    alone = [[sampler._sample(rows[i:i + 1].clone(), {0: g})[0].item() for i, g in
              enumerate([torch.Generator().manual_seed(s) for s in seeds.values()])]]
    first, moved = draws((0, 2)), draws((4, 1))
    expect(first[0] == alone[0], f"seeds 7 and 8 drew {alone[0]} alone, {first[0]} as rows 0 "
           "and 2 of a batch: a seeded row's noise comes from its generator alone")
    expect(first == moved, "two seeded rows drew other tokens as rows 4 and 1 of a batch than "
           "as rows 0 and 2: a seeded row's noise comes from its generator alone")
    expect(len({tuple(t) for t in first}) > 1, "30 calls with the same seeded generators drew "
           "the same tokens every time: a seeded generator goes on from call to call")
    say("two seeded rows draw the same 30 tokens each as rows 0 and 2 or 4 and 1 of a batch, "
        "and alone; a generator goes on from call to call")


# -- 9.3 the router of a mixture of experts ----------------------------------------------------
def expect_same_routing(mine, logits, top_k: int, renormalize: bool) -> None:
    """The learner's (weights, ids) for `logits` agree with nanoserve's select_experts: a top-k
    set of experts (any of tied ones), each with its weight; the columns in any order."""
    import torch

    from nanoserve.layers import select_experts
    case = f"logits {logits.tolist()}, top_k {top_k}, renormalize {renormalize}"
    weights, ids = mine(logits.clone(), top_k, renormalize)
    with oracle():
        want_w, _ = select_experts(logits, top_k, renormalize)
    expect(weights.dtype == torch.float32, f"{case}: weights must be float32 (got {weights.dtype}):"
           " take the softmax in float32, whatever the logits' dtype")
    expect(tuple(weights.shape) == tuple(ids.shape) == (logits.shape[0], top_k), f"{case}: "
           f"weights and ids must be [tokens, top_k] (got {tuple(weights.shape)}, {tuple(ids.shape)})")
    expect(not ids.is_floating_point(), f"{case}: ids must be integers (got {ids.dtype})")
    probs = torch.softmax(logits.float(), dim=-1)
    for row, (w, i) in enumerate(zip(weights, ids.long())):
        expect(len(set(i.tolist())) == top_k, f"{case}: token {row} got experts {i.tolist()}: "
               "k different experts")
        expect(torch.allclose(probs[row].topk(top_k).values, probs[row, i].sort(descending=True)
                              .values), f"{case}: token {row} got experts {i.tolist()}, not "
               f"the {top_k} most probable (probabilities {probs[row].tolist()})")
        expect(torch.allclose(w.sort().values, want_w[row].sort().values, atol=1e-6),
               f"{case}: token {row}'s weights are {w.tolist()}, nanoserve's "
               f"{want_w[row].tolist()}")


def check_router(mod, say) -> None:
    import tempfile

    import torch

    from moe_checkpoint import build
    from nanoserve.layers import FusedMoE, select_experts
    with own_work(mod, ["select_experts"], [select_experts], "route with torch yourself"):
        example = torch.tensor([[0.0, 2.0, 1.0, 2.0]])
        for renormalize in (True, False):
            expect_same_routing(mod.select_experts, example, 2, renormalize)
        say("logits [0, 2, 1, 2], top-2: experts 1 and 3, weights 0.5 / 0.5 renormalized, 0.40 "
            "/ 0.40 not")
        gen = torch.Generator().manual_seed(0)
        cases = [(torch.tensor([[1.0, 1.0, 1.0, 0.0], [3.0, 3.0, 3.0, 3.0]]), 2),      # ties
                 (torch.randn(6, 8, generator=gen), 1), (torch.randn(6, 8, generator=gen), 2),
                 (torch.randn(5, 16, generator=gen) * 4, 3),
                 ((torch.randn(4, 8, generator=gen) * 3).bfloat16(), 2),
                 (torch.randn(7, 128, generator=gen), 8),              # Qwen3-MoE's shape
                 ((torch.randn(3, 60, generator=gen) * 2).bfloat16(), 4)]
        for logits, top_k in cases:
            for renormalize in (True, False):
                expect_same_routing(mod.select_experts, logits, top_k, renormalize)
        say("ties, top-1 to top-8 of 4 to 128 experts, renormalize on and off, bfloat16 logits: "
            "nanoserve's experts and weights")
        calls = []

        def counted(router_logits, top_k, renormalize):
            calls.append(router_logits.shape[0])
            return mod.select_experts(router_logits, top_k, renormalize)
        with tempfile.TemporaryDirectory() as tmp:
            # Qwen3-MoE without norm_topk_prob (the weights sum to less than 1), Mixtral with it
            for arch, extra in (("qwen3_moe", dict(norm_topk_prob=False)), ("mixtral", {})):
                with oracle():
                    path = build(f"{tmp}/{arch}", arch, experts=8, top_k=2, num_hidden_layers=2,
                                 **extra)
                llm = small_llm(model=str(path))
                moes = [m for m in llm.engine.executor.model_runner.model.modules()
                        if isinstance(m, FusedMoE)]
                expect(bool(moes), "no FusedMoE in the model (check bug)")
                for m in moes:
                    m.custom_routing_function = counted
                calls.clear()
                expect_hf_greedy(llm, prompt_ids(llm), 12)
                expect(len(calls) >= 12 * len(moes), f"your router was called {len(calls)} "
                       "times (check bug: the engine routed without it)")
                for m in moes:
                    m.custom_routing_function = None
    say("in the real engine, your router in every MoE layer: a tiny Qwen3-MoE (norm_topk_prob "
        "false) and a tiny Mixtral, 4 prompts each, HF transformers' greedy tokens")
