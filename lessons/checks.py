"""checks.py: the checks behind `nanoserve exercise`, for the lessons' build exercises.

    nanoserve exercise list                    # every build exercise and its file
    nanoserve exercise check 3.3               # your file, lessons/exercises/lesson3_....py
    nanoserve exercise check 3.3 --solution    # the reference, lessons/solutions/lesson3_....py

Every check is an oracle: the same input goes through your code and through nanoserve (or a
brute-force reference), and the answers must agree. The scheduler and KV cache exercises run
on tests/fake_engine.py, a model-free engine whose "model" stores every token through the
block tables and reads it back, so a wrong schedule or a wrongly shared block shows up as a
wrong output token (checks_scheduler.py, checks_cache.py). Your own code must do the work
(check_kit.own_work): the functions and methods are written in your file, and nanoserve's own
version of the mechanism, or the reference solution, never runs while yours does, however it
is reached. Every check runs at least two shapes (blocks of 4 and 16 tokens, GQA 2:1 and 4:1,
...) and the cases its mechanism gets wrong most easily. Every check is run against plausible
wrong answers too (tests/lesson_mutants/), and must reject each of them. CI runs every check
against the solutions (tests/test_lessons.py), which proves each check can pass; the untouched
starters must fail, saying what to implement.
"""

from __future__ import annotations

import sys
import traceback
from pathlib import Path
from typing import Callable, NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parent))    # check_kit, checks_scheduler
import checks_cache as cache  # noqa: E402
import checks_clinic as clinic  # noqa: E402
import checks_engine as engine  # noqa: E402
import checks_scheduler as scheduling  # noqa: E402
from check_kit import LESSONS, aten_ops, expect, load, own_work, untouched  # noqa: E402


# -- 1.3 the engine loop ---------------------------------------------------------------------
def check_engine_loop(mod, say) -> None:
    from nanoserve import LLM, SamplingParams
    from nanoserve.engine_core import run_busy_loop
    loops = [LLM.generate, LLM.stream, LLM._run, LLM._steps, run_busy_loop]
    # Two seats for three prompts, and a pool so small that a running request is preempted:
    # not every request gets a token in every step. Blocks of 4 tokens, then of 16.
    for block_size, num_blocks in ((4, 8), (16, 2)):
        llm = LLM(block_size=block_size, num_kv_blocks=num_blocks, max_model_len=32,
                  max_num_seqs=2)
        prompts = [llm.tokenizer.encode(t) for t in
                   ("Once upon a time", "The cat sat on the mat", "Tom and Lily went to the park")]
        core, steps = llm.engine, []
        step = core.step
        core.step = lambda: steps.append(sys._getframe(1).f_code.co_filename) or step()
        with own_work(mod, ["generate"], loops, "drive core.step() in your own loop"):
            got = mod.generate(core, prompts, 12)
        del core.step
        expect(steps and set(steps) == {mod.__file__}, f"{len(steps)} steps, "
               f"{steps.count(mod.__file__)} of them called by your own code: call core.step() "
               "yourself, in your loop")
        expect(core.scheduler.num_preemptions_total > 0, "no preemption happened (check bug)")
        pool = core.kv_cache_manager.pool
        expect(not core.has_unfinished_requests() and pool.num_free_blocks == pool.num_blocks,
               "after generate() the engine must be idle with every block free: return only "
               "once every request has finished")
        want = [o.outputs[0].token_ids for o in llm.generate(
            [{"prompt_token_ids": p} for p in prompts],
            SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), progress=False)]
        expect(got == want, f"block_size {block_size}: your tokens differ from LLM.generate's:"
               f"\n  yours: {got}\n  LLM:   {want}")
    say("3 prompts, 12 tokens each, 2 seats, blocks of 4 and of 16, preempted on the way: token "
        "for token the same as LLM.generate, every step from your loop; every block freed")


# -- 2.3 paged decode attention ------------------------------------------------------------------
def reference_attention():
    from nanoserve import paged_attention
    from nanoserve.cpu import kernels
    return [paged_attention.paged_attention_torch, paged_attention.attend_each,
            paged_attention._gather_kv, paged_attention._attend_one, kernels.attention_kernel,
            kernels.load]


def paged_case(gen, seq_len, block_size, heads, kv_heads, dim):
    """Caches full of garbage (a correct read never looks past the request's seq_len slots), the
    request's K/V stored through a shuffled block table, a query; and dense K/V to compare."""
    import torch

    from nanoserve.paged_attention import store_kv_torch
    num_blocks = 3 * -(-seq_len // block_size) + 2
    k_cache = torch.full((num_blocks, block_size, kv_heads, dim), 1e4)
    v_cache = torch.full((num_blocks, block_size, kv_heads, dim), 1e4)
    table = torch.randperm(num_blocks, generator=gen)[:-(-seq_len // block_size)].tolist()
    k, v = (torch.randn(seq_len, kv_heads, dim, generator=gen) for _ in range(2))
    pos = torch.arange(seq_len)
    slots = torch.tensor(table)[pos // block_size] * block_size + pos % block_size
    store_kv_torch(k, v, k_cache, v_cache, slots)
    return k_cache, v_cache, table, k, v, torch.randn(heads, dim, generator=gen)


def check_paged_decode(mod, say) -> None:
    import torch
    gen = torch.Generator().manual_seed(0)
    shapes = [(4, 4, 2, 8, 8 ** -0.5), (16, 8, 2, 16, 0.3), (16, 4, 4, 8, 1.0)]
    for block_size, heads, kv_heads, dim, scale in shapes:
        for seq_len in (1, block_size, block_size + 1, 3 * block_size + 1):
            k_cache, v_cache, table, k, v, query = paged_case(gen, seq_len, block_size, heads,
                                                             kv_heads, dim)
            with own_work(mod, ["paged_decode_attention"], reference_attention(),
                          "read K and V through the block table yourself"):
                got = mod.paged_decode_attention(query, k_cache, v_cache, list(table), seq_len,
                                                 scale)
            expect(tuple(got.shape) == (heads, dim), f"the output must be [num_heads, head_dim] "
                   f"= [{heads}, {dim}] (got {list(got.shape)})")
            group = heads // kv_heads
            dense = torch.nn.functional.scaled_dot_product_attention(
                query[:, None], k.transpose(0, 1).repeat_interleave(group, 0),
                v.transpose(0, 1).repeat_interleave(group, 0), scale=scale)[:, 0]
            expect(torch.allclose(got, dense, atol=1e-4),
                   f"block_size {block_size}, {heads} query heads over {kv_heads} KV heads, scale "
                   f"{scale:.3g}, seq_len {seq_len}, block_table {table}: your output differs "
                   f"from dense attention by {(got - dense).abs().max():.3g} (read only the "
                   f"first seq_len slots, in block-table order; each KV head serves "
                   f"{group} consecutive query heads; scale the scores by `scale`)")
    say("blocks of 4 and 16, GQA 2:1, 4:1 and none, scales 8^-0.5, 0.3 and 1, seq_len from 1 to "
        "3 blocks + 1 over shuffled block tables: equal to dense SDPA")


# -- 6.3 KV sizing ------------------------------------------------------------------------------
def check_kv_sizing(mod, say) -> None:
    import json
    import tempfile
    from dataclasses import replace

    from nanoserve.tools.memory import memory_report
    llama = LESSONS.parent / "examples" / "llama-3-8b-config.json"
    tiny = LESSONS.parent / "nanoserve" / "assets" / "nanoserve-tiny" / "config.json"
    base = json.loads(llama.read_text())
    folder = Path(tempfile.mkdtemp())
    variants = {"own_head_dim": dict(base, head_dim=64, num_key_value_heads=4),
                "no_kv_heads_field": {k: v for k, v in base.items() if k != "num_key_value_heads"}}
    for name, config in variants.items():
        (folder / f"{name}.json").write_text(json.dumps(config))
    cases = [(tiny, {}), (llama, dict(device_memory_gb=24)),
             (llama, dict(device_memory_gb=40, kv_cache_dtype="fp8")),
             (llama, dict(device_memory_gb=40, tensor_parallel_size=2)),
             (llama, dict(device_memory_gb=80, tensor_parallel_size=16)),
             (folder / "own_head_dim.json", dict(device_memory_gb=40)),
             (folder / "no_kv_heads_field.json", dict(device_memory_gb=80))]
    for path, case in cases:
        r = memory_report(model=str(tiny.parent if path == tiny else path), **case)
        with own_work(mod, ["kv_bytes_per_token"], reference_sizing(), "compute it yourself"):
            got = mod.kv_bytes_per_token(json.loads(path.read_text()), r.kv_cache_dtype.itemsize,
                                         r.tensor_parallel_size)
        expect(got == r.kv_bytes_per_token, f"{path.name} {case}: kv_bytes_per_token {got}, "
               f"nanoserve memory says {r.kv_bytes_per_token} per GPU")
    say(f"bytes per token on one GPU agree with `nanoserve memory` on {len(cases)} setups "
        "(TP 2 and 16, fp8, an explicit head_dim, no num_key_value_heads)")
    for block_size, seqs in ((16, 8), (16, 12), (32, 20), (8, 7)):
        r = memory_report(model=str(llama), device_memory_gb=24, block_size=block_size)
        with own_work(mod, ["max_model_len_for"], reference_sizing(), "compute it yourself"):
            length = mod.max_model_len_for(r.num_blocks, r.block_size, seqs)
        fits, more = (replace(r, max_model_len=n).num_seqs for n in (length, length + 1))
        expect(fits >= seqs > more, f"max_model_len_for({r.num_blocks}, {block_size}, {seqs}) = "
               f"{length}: at that length {fits} sequences fit, at {length + 1} {more}; the "
               f"answer is the largest length at which {seqs} fit, a whole number of blocks")
    say("max_model_len_for: the largest length at which 7 to 20 sequences of Llama-3-8B fit on "
        "24 GiB, in blocks of 8, 16 and 32 tokens")


def reference_sizing():
    from nanoserve import model_loader
    from nanoserve.models import geometry
    from nanoserve.tools import memory
    return [model_loader.kv_cache_bytes_per_token, geometry.get_num_kv_heads,
            geometry.get_head_size, memory.memory_report,
            memory.MemoryReport.num_seqs.fget, memory.MemoryReport.blocks_per_seq.fget]


# -- 7.3 top-k without a sort -----------------------------------------------------------------
SORTS = {"sort", "sorted", "argsort", "msort", "topk", "kthvalue", "quantile", "nanquantile",
         "median", "nanmedian", "unique", "mode"}


# What orders a row outside torch: numpy (sort, partition), Python's sorted and list.sort, heapq.
SHUNNED = ("numpy", "heapq", "sorted", "sort")


def top_k_cases():
    """(logits, top_k): rows full of ties, k from 1 to the vocabulary; then rows holding -inf
    (what min_p, a grammar mask or min_tokens leave), k above and below the finite count."""
    import torch
    gen = torch.Generator().manual_seed(0)
    vocab = 1000
    yield ((torch.randn(6, vocab, generator=gen) * 3).round(),
           torch.tensor([1, 5, 50, vocab, 3, vocab - 1]))
    vocab, inf = 4096, float("-inf")
    logits = torch.randn(5, vocab, generator=gen) * 100
    logits[0, ::2] = inf
    logits[1, 10:] = inf
    logits[2, 1:] = inf
    logits[3, torch.randperm(vocab, generator=gen)[:4000]] = inf
    yield logits, torch.tensor([3, 20, 1, 96, vocab])


def check_top_k(mod, say) -> None:
    import ast

    import torch

    from nanoserve import sampler
    # A sort shows in the source (any spelling: torch.sort, a name imported early, Python's
    # sorted) or, at run time, as an aten op below torch's Python API (quantile, unique, ...).
    named = sorted({node.attr if isinstance(node, ast.Attribute) else node.id
                    for node in ast.walk(ast.parse(Path(mod.__file__).read_text()))
                    if isinstance(node, (ast.Attribute, ast.Name))
                    and (node.attr if isinstance(node, ast.Attribute) else node.id) in SORTS})
    expect(not named, f"your file uses {', '.join(named)}: find each row's cut-off by comparing "
           "and counting, without ordering a row")
    for logits, top_k in top_k_cases():
        vocab = logits.shape[1]
        want = sampler.apply_top_k_top_p(logits.clone(), top_k, int(top_k[top_k < vocab].max()),
                                         None)
        with own_work(mod, ["top_k_mask"], [sampler.apply_top_k_top_p],
                      "find each row's cut-off by comparing and counting", SHUNNED), \
                aten_ops() as ops:
            got = mod.top_k_mask(logits.clone(), top_k)
        sorts = sorted({name for name in ops if name.lstrip("_").split("_")[0] in SORTS})
        expect(not sorts, f"your code ordered a row ({', '.join(sorts)}): find each row's "
               "cut-off by comparing and counting")
        rows = sorted(set(torch.nonzero(got != want)[:, 0].tolist())) if got.shape == want.shape \
            else "all"
        expect(got.shape == want.shape and torch.equal(got, want),
               f"vocab {vocab}, top_k {top_k.tolist()}: rows {rows} differ from nanoserve's "
               "top-k: keep each row's k largest logits and every logit tied with the k-th, set "
               "the rest to -inf; rows with top_k >= vocab keep everything; a row may hold -inf")
    say("6 rows with ties, top_k 1..vocab; 5 rows holding -inf, k above and below the finite "
        "count: equal to nanoserve's sampler, no row ordered, no numpy")
    logits = next(top_k_cases())[0]
    ops_for = {}
    for k in (2, logits.shape[1] - 2):
        with own_work(mod, ["top_k_mask"]), aten_ops() as ops:
            mod.top_k_mask(logits.clone(), torch.full((logits.shape[0],), k))
        ops_for[k] = len(ops)
    few, many = ops_for.values()
    expect(many <= 2 * few + 20, f"with k = 2 your code ran {few} torch ops, with k = "
           f"{logits.shape[1] - 2} {many}: the work per row must not grow with k")
    say(f"the same work for k = 2 and k = vocab - 2 ({few} and {many} torch ops)")


# -- 8.3 the n-gram proposer ------------------------------------------------------------------
def check_ngram_proposer(mod, say) -> None:
    import random

    from nanoserve.spec_decode import NgramProposer
    rng = random.Random(0)
    cases = []
    for vocab in (2, 3, 5, 20):          # sequences up to 160 tokens, n-grams up to 10
        for _ in range(300):
            seq = [rng.randrange(vocab) for _ in range(rng.randint(1, 160))]
            k, low = rng.randint(1, 8), rng.randint(1, 4)
            high = low + rng.randint(0, 6)
            cases.append((seq, k, low, high, NgramProposer(k, low, high).propose(seq, k)))
    with own_work(mod, ["propose"], [NgramProposer.propose], "find the match yourself"):
        got = [list(mod.propose(list(seq), k, low, high)) for seq, k, low, high, _ in cases]
    for (seq, k, low, high, want), mine in zip(cases, got):
        expect(mine == want, f"propose({seq}, k={k}, min_n={low}, max_n={high}) gave {mine}, "
               f"nanoserve proposes {want}: the k tokens after the longest (then most recent) "
               "earlier match of the last n tokens, min_n <= n <= max_n")
    say(f"{len(cases)} random sequences of up to 160 tokens over vocabularies of 2 to 20 tokens, "
        "n-grams up to 10, k up to 8: the same drafts as nanoserve's NgramProposer")


class Exercise(NamedTuple):
    file: str
    title: str
    check: Callable


EXERCISES = {
    "1.3": Exercise("lesson1_engine_loop.py", "the engine loop, by hand", check_engine_loop),
    "2.3": Exercise("lesson2_paged_decode.py", "decode attention through a block table",
                    check_paged_decode),
    "2.4": Exercise("lesson2_batch_indices.py", "positions, slot_mapping, query_start_loc",
                    engine.check_batch_indices),
    "3.3": Exercise("lesson3_shortest_job_first.py", "a shortest-job-first waiting queue",
                    scheduling.check_shortest_job_first),
    "3.4": Exercise("lesson3_static_batching.py", "static batching, to compare",
                    scheduling.check_static_batching),
    "3.5": Exercise("lesson3_chunked_running.py", "the running half of the scheduler",
                    engine.check_schedule_running),
    "4.3": Exercise("lesson4_cheapest_victim.py", "preempt the cheapest request to recompute",
                    scheduling.check_cheapest_victim),
    "4.4": Exercise("lesson4_allocate_slots.py", "allocate_slots, all or nothing",
                    cache.check_allocate_slots),
    "5.3": Exercise("lesson5_hit_count_eviction.py", "evict the block with the fewest hits",
                    cache.check_hit_count_eviction),
    "5.4": Exercise("lesson5_hash_chain.py", "the prefix-cache hash chain",
                    cache.check_hash_chain),
    "6.3": Exercise("lesson6_kv_sizing.py", "the KV budget from a config.json", check_kv_sizing),
    "7.3": Exercise("lesson7_top_k.py", "top-k by comparing and counting", check_top_k),
    "7.4": Exercise("lesson7_exponential_race.py", "the sampler's exponential race",
                    engine.check_exponential_race),
    "8.3": Exercise("lesson8_ngram_proposer.py", "the n-gram proposer", check_ngram_proposer),
    "9.3": Exercise("lesson9_router.py", "the router of a mixture of experts",
                    engine.check_router),
    "10.4": Exercise("lesson10_clinic.py", "the clinic's prescriptions", clinic.check_clinic),
}


def path_of(exercise_id: str, solution: bool = False) -> Path:
    if exercise_id not in EXERCISES:
        raise ValueError(f"exercise must be one of {', '.join(EXERCISES)} (got {exercise_id!r})")
    return LESSONS / ("solutions" if solution else "exercises") / EXERCISES[exercise_id].file


def check(exercise_id: str, solution: bool = False, say=print, path: Path | None = None) -> bool:
    """Run one exercise's checks on the starter, the solution, or any file `path`; True when all
    pass. Says what passed, or why not."""
    path = path or path_of(exercise_id, solution)
    say(f"exercise {exercise_id}, {EXERCISES[exercise_id].title}: "
        f"{path.relative_to(LESSONS.parent) if LESSONS.parent in path.parents else path}")
    try:
        with untouched(path):
            mod = load(path)
            mod.reference_solution = path_of(exercise_id, solution=True)  # (own_work bans it)
            EXERCISES[exercise_id].check(mod, lambda line: say(f"  ok   {line}"))
    except NotImplementedError as e:
        say(f"  FAIL not implemented yet: {e}")
        return False
    except AssertionError as e:
        say(f"  FAIL {e}")
        return False
    except Exception:   # the learner's code crashed: show where, in their file
        say("  FAIL your code raised:\n" + traceback.format_exc(limit=-3))
        return False
    say("  passed")
    return True


def main(action: str, exercise_id: str | None = None, solution: bool = False) -> int:
    """`nanoserve exercise list | check ID [--solution]`; returns the exit status."""
    if action == "list":
        for eid, ex in EXERCISES.items():
            print(f"{eid}  {ex.title:45} lessons/exercises/{ex.file}")
        return 0
    if exercise_id is None:
        raise ValueError("exercise: give the exercise to check, e.g. "
                         "`nanoserve exercise check 3.3`")
    return 0 if check(exercise_id, solution) else 1
