"""replay_plots.py: a trace as numbers, figures and a Chrome/Perfetto timeline.

    nanoserve trace traces/preemption_storm.jsonl --summary           # a table
    nanoserve trace traces/preemption_storm.jsonl --plot figs/        # four PNGs
    nanoserve trace traces/preemption_storm.jsonl --plot figs/ --lang ja   # in Japanese
    nanoserve trace traces/preemption_storm.jsonl --chrome run.json   # open in ui.perfetto.dev

The summary's latencies come from the trace's clock: a token's time is the end of the step
that sampled it; time to first token = first token - arrival; inter-token latency = the
gaps between a request's tokens; end to end = finish - arrival. Percentiles interpolate
linearly between ranks (numpy's default): p50 of [0.1, 0.2] is 0.15.

The figures, all over the engine's step number (one step = one forward pass):
- gantt.png: one row per request: waiting, prefill chunks, decode steps, preemptions (x);
- kv_blocks.png: KV blocks used / cached free / free, stacked, preemptions marked;
- tokens.png: tokens per step, prefill and decode, against max_num_batched_tokens;
- latency_cdf.png: CDFs of time to first token and end-to-end latency;
- expert_load.png (a mixture of experts' trace only): each MoE layer's share of tokens per expert
  over the run, and its imbalance (max / mean) step by step.

Figures are drawn on `matplotlib.figure.Figure` directly (no pyplot), so no display and no
global backend are needed. Input is a `Trace` (nanoserve/trace.py reads the file); this module
never imports the engine, nor replay.py (cli.py runs the replay, then `main` here).
"""

from __future__ import annotations

import json
import os
from itertools import pairwise
from typing import Optional

from matplotlib.figure import Figure
from rich.console import Console
from rich.table import Table

from nanoserve.tools.figure_text import t, use
from nanoserve.trace import Trace

COLOURS = {"wait": "#d9d9d9", "prefill": "#f0a030", "decode": "#3a9a4a"}


def main(trace: Trace, with_summary: bool = False, plot: Optional[str] = None,
         chrome: Optional[str] = None, compare: Optional[str] = None,
         console: Optional[Console] = None, lang: str = "en") -> None:
    """`nanoserve trace`'s other outputs, each asked for: the summary table (`compare`: a
    second trace's summary beside it), the figures into the folder `plot` (their words in
    `lang`: figure_text.py), the Chrome JSON."""
    console = console or Console()
    if with_summary or compare:
        console.print(summary_table(trace, *([Trace.load(compare)] if compare else [])))
    for written in write_plots(trace, plot, lang) if plot else []:
        console.print(f"wrote {written}")
    if chrome:
        with open(chrome, "w", encoding="utf-8") as f:
            json.dump(chrome_trace(trace), f)
        console.print(f"wrote {chrome} (open it in ui.perfetto.dev)")


def summary(trace: Trace) -> dict:
    """Counts, the prefix-cache hit rate (cached / queried prompt tokens, as kv_cache.py
    counts them) and latency percentiles in seconds."""
    reqs = list(trace.requests.values())
    busy = [f.schedule for f in trace.frames.values() if f.schedule.get("scheduled")]
    times = [trace.token_times(r) for r in reqs]
    reasons: dict[str, int] = {}
    for r in reqs:
        reasons[r.reason or "unfinished"] = reasons.get(r.reason or "unfinished", 0) + 1
    caching = trace.config.get("enable_prefix_caching", True) and trace.prefix_queries
    return {
        "requests": len(reqs), "finished": reasons, "steps": len(busy),
        "preemptions": sum(len(r.preempt_steps) for r in reqs),
        "prefix_hit_rate": trace.prefix_hits / trace.prefix_queries if caching else None,
        "mean_batch_size": sum(len(s["scheduled"]) for s in busy) / max(len(busy), 1),
        "mean_tokens_per_step": sum(sum(s["scheduled"].values()) for s in busy) / max(len(busy), 1),
        "output_tokens": sum(len(ts) for ts in times),
        # structured outputs: the requests with a grammar, and how many steps masked their logits
        "structured_requests": sum(1 for r in reqs if r.masked_steps),
        "masked_steps": sum(len(r.masked_steps) for r in reqs),
        "ttft_s": percentiles([ts[0] - r.arrive_t for r, ts in zip(reqs, times) if ts]),
        "itl_s": percentiles([b - a for ts in times for a, b in pairwise(ts)]),
        "e2e_s": percentiles([r.finish_t - r.arrive_t for r in reqs if r.finish_t is not None]),
        "expert_load": expert_load(trace),
    }


def imbalance(counts) -> float:
    """max / mean of an expert load: 1.0 when every expert got as many tokens, E when one of E
    got them all (the slowest expert sets the layer's time; vLLM's EPLB balances this number)."""
    total = sum(counts)
    return max(counts) * len(counts) / total if total else 1.0


def expert_load(trace: Trace) -> Optional[dict]:
    """A mixture of experts' routing over the run (None for a dense model's trace): per MoE
    layer, the tokens each expert received in all, and that total's imbalance."""
    if not trace.expert_load:
        return None
    totals = [[sum(steps) for steps in zip(*layer)] for layer in zip(*trace.expert_load.values())]
    return {"layers": len(totals), "experts": len(totals[0]), "totals": totals,
            "imbalance": [imbalance(t) for t in totals]}


def percentiles(values: list[float], qs=(50, 90, 99)) -> Optional[dict[str, float]]:
    if not values:
        return None
    v, out = sorted(values), {}
    for q in qs:
        k = (len(v) - 1) * q / 100
        lo = int(k)
        out[f"p{q}"] = v[lo] + (v[min(lo + 1, len(v) - 1)] - v[lo]) * (k - lo)
    return out


def summary_table(*traces: Trace) -> Table:
    """The summary of one trace; of several, side by side, a column each (`--compare`)."""
    several = len(traces) > 1
    table = Table(title=None if several else traces[0].path, show_header=several,
                  title_justify="left")
    for header in ["", *(t.path if several else "" for t in traces)]:
        table.add_column(header)

    def ms(p: Optional[dict]) -> str:
        return " / ".join(f"{v * 1e3:.1f}" for v in p.values()) + " ms" if p else "-"

    def structured(s: dict) -> str:
        return (f"{s['structured_requests']} requests, {s['masked_steps']} request-steps masked "
                "by their grammar") if s["structured_requests"] else "-"

    def experts(s: dict) -> str:
        load = s["expert_load"]
        if load is None:
            return "-"
        worst = max(range(load["layers"]), key=load["imbalance"].__getitem__)
        return (f"{load['experts']} experts x {load['layers']} MoE layers; imbalance (max/mean) "
                f"{sum(load['imbalance']) / load['layers']:.2f} on average, "
                f"{load['imbalance'][worst]:.2f} at worst (MoE layer {worst})")

    def column(s: dict) -> list[str]:
        rate, reasons = s["prefix_hit_rate"], ", ".join(f"{k} {v}" for k, v in s["finished"].items())
        return [f"{s['requests']} ({reasons})", str(s["steps"]), str(s["preemptions"]),
                "off" if rate is None else f"{rate:.1%} of prompt tokens",
                f"{s['mean_batch_size']:.2f} requests, {s['mean_tokens_per_step']:.1f} tokens per "
                "step", str(s["output_tokens"]), structured(s), experts(s), ms(s["ttft_s"]),
                ms(s["itl_s"]), ms(s["e2e_s"])]
    names = ["requests", "steps", "preemptions", "prefix cache hit rate", "mean batch size",
             "output tokens", "structured outputs", "expert load", "time to first token p50/p90/p99",
             "inter-token latency p50/p90/p99", "end-to-end latency p50/p90/p99"]
    for name, *values in zip(names, *(column(summary(t)) for t in traces)):
        table.add_row(name, *values)
    return table


def write_plots(trace: Trace, out_dir: str, lang: str = "en") -> list[str]:
    """Draw the figures into out_dir (created if missing), their words in `lang`; returns their
    paths."""
    use(lang)
    os.makedirs(out_dir, exist_ok=True)
    paths = []
    figures = [("gantt", gantt), ("kv_blocks", kv_blocks), ("tokens", tokens),
               ("latency_cdf", latency_cdf)] + ([("expert_load", expert_load_figure)]
                                                if trace.expert_load else [])
    for name, draw in figures:
        fig = draw(trace)
        fig.suptitle(f"{os.path.basename(trace.path)}: {fig.get_suptitle()}", fontsize=11)
        path = os.path.join(out_dir, f"{name}.png")
        fig.savefig(path, dpi=110, bbox_inches="tight")
        paths.append(path)
    return paths


def _schedules(trace: Trace) -> list[dict]:
    return [f.schedule for f in trace.frames.values() if f.schedule]


def _preempt_steps(trace: Trace) -> list[int]:
    return sorted({s for r in trace.requests.values() for s in r.preempt_steps})


def gantt(trace: Trace) -> Figure:
    reqs = list(trace.requests.values())
    last = max(trace.frames)
    fig = Figure(figsize=(10, 1.6 + 0.28 * len(reqs)), layout="constrained")
    ax = fig.add_subplot()
    for y, r in enumerate(reqs):
        # Run-length encode the request's row: one bar per run of equal kinds.
        runs: list[list] = []
        for s in range(1, last + 1):
            kind = r.kind(s)
            kind = "decode" if kind == "finish" else kind
            if runs and runs[-1][0] == kind and runs[-1][1] + runs[-1][2] == s:
                runs[-1][2] += 1
            elif kind in COLOURS:
                runs.append([kind, s, 1])
        for kind in COLOURS:
            spans = [(s - 0.5, n) for k, s, n in runs if k == kind]
            ax.broken_barh(spans, (y - 0.4, 0.8), color=COLOURS[kind],
                           label=t(kind) if y == 0 else None)
        ax.scatter(r.preempt_steps, [y] * len(r.preempt_steps), marker="x", color="red",
                   zorder=3, label=t("preempted") if r.preempt_steps and t("preempted") not
                   in ax.get_legend_handles_labels()[1] else None)
    ax.set_yticks(range(len(reqs)), [r.label for r in reqs])
    ax.invert_yaxis()
    return _over_steps(fig, ax, t("request"), t("requests over steps"))


def _over_steps(fig: Figure, ax, ylabel: str, title: str, legend_columns: int = 4) -> Figure:
    """The common ending of the figures drawn over the step number: labels, legend below, title."""
    ax.set_xlabel(t("step"))
    ax.set_ylabel(ylabel)
    fig.legend(loc="outside lower center", ncol=legend_columns, fontsize=8, frameon=False)
    fig.suptitle(title)
    return fig


def kv_blocks(trace: Trace) -> Figure:
    """From each step's `schedule` event: the pool as the step ran (exact counts)."""
    sched = _schedules(trace)
    steps = [s["step"] for s in sched]
    used = [s["kv_used"] for s in sched]
    cached = [s["kv_cached"] for s in sched]
    free = [s["kv_free"] - s["kv_cached"] for s in sched]
    fig = Figure(figsize=(10, 3.8), layout="constrained")
    ax = fig.add_subplot()
    ax.stackplot(steps, used, cached, free, labels=[t("used"), t("cached"), t("free")],
                 colors=["#8e44ad", "#58b368", "#e8e8e8"], step="mid")
    for i, s in enumerate(_preempt_steps(trace)):
        ax.axvline(s, color="red", lw=0.8, ls="--", label=t("preemption") if i == 0 else None)
    ax.set_ylim(0, trace.num_blocks)
    return _over_steps(fig, ax, t("KV blocks"), t("KV cache pool", n=trace.num_blocks))


def tokens(trace: Trace) -> Figure:
    sched = _schedules(trace)
    steps = [s["step"] for s in sched]
    prefill = [s["num_prefill_tokens"] for s in sched]
    decode = [s["num_decode_tokens"] for s in sched]
    fig = Figure(figsize=(10, 3.8), layout="constrained")
    ax = fig.add_subplot()
    ax.bar(steps, prefill, width=1.0, color=COLOURS["prefill"], label=t("prefill"))
    ax.bar(steps, decode, width=1.0, bottom=prefill, color=COLOURS["decode"], label=t("decode"))
    top = max((p + d for p, d in zip(prefill, decode)), default=1)
    budget = t("budget", n=trace.budget or "?")
    if trace.budget and trace.budget <= 4 * top:     # else the bars would be slivers under it
        ax.axhline(trace.budget, color="black", ls="--", lw=1, label=budget)
        ax.set_ylim(0, trace.budget * 1.1)
    else:
        ax.set_title(t("far above", budget=budget), fontsize=9)
    return _over_steps(fig, ax, t("tokens"), t("tokens per step"), legend_columns=3)


def expert_load_figure(trace: Trace) -> Figure:
    """Left: each MoE layer's tokens per expert over the run, as shares of the layer's total
    (even routing: every cell 1 / E). Right: each layer's imbalance (max / mean), step by step."""
    load, steps = expert_load(trace), sorted(trace.expert_load)
    shares = [[n / max(sum(row), 1) for n in row] for row in load["totals"]]
    per_step = [[imbalance(trace.expert_load[s][layer]) for s in steps]
                for layer in range(load["layers"])]
    fig = Figure(figsize=(11, 1.8 + 0.22 * load["layers"]), layout="constrained")
    left, right = fig.subplots(1, 2, width_ratios=[1, 2])
    fig.colorbar(left.imshow(shares, aspect="auto", cmap="viridis", interpolation="nearest"),
                 ax=left, label=t("share of tokens"))
    left.set_xlabel(t("expert"))
    left.set_ylabel(t("MoE layer"))
    image = right.imshow(per_step, aspect="auto", cmap="magma", interpolation="nearest",
                         extent=(steps[0] - 0.5, steps[-1] + 0.5, load["layers"] - 0.5, -0.5))
    fig.colorbar(image, ax=right, label=t("imbalance"))
    right.set_xlabel(t("step"))
    fig.suptitle(t("expert load", experts=load["experts"], layers=load["layers"]))
    return fig


def latency_cdf(trace: Trace) -> Figure:
    reqs = list(trace.requests.values())
    ttft = [trace.token_times(r)[0] - r.arrive_t for r in reqs if r.token_steps]
    e2e = [r.finish_t - r.arrive_t for r in reqs if r.finish_t is not None]
    fig = Figure(figsize=(10, 3.5), layout="constrained")
    for i, (name, values) in enumerate((("time to first token", ttft),
                                        ("end-to-end latency", e2e))):
        ax = fig.add_subplot(1, 2, i + 1)
        v = sorted(values)
        ax.step(v, [(k + 1) / len(v) for k in range(len(v))], where="post")
        ax.set_xlabel(t(name))
        ax.set_ylabel(t("fraction of requests"))
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
    fig.suptitle(t("latency CDFs"))
    return fig


def chrome_trace(trace: Trace) -> dict:
    """Trace-event JSON: a track of engine steps, one track per request (its prefill and
    decode steps; arrive, preempt and finish marks), and counters of the pool and batch."""
    def us(t: float) -> float:
        return round(t * 1e6, 1)

    out = [{"ph": "M", "pid": 1, "tid": 0, "name": "thread_name", "args": {"name": "engine steps"}}]
    for step, (start, end) in sorted(trace.spans.items()):
        s = trace.frames[step].schedule
        out.append({"ph": "X", "pid": 1, "tid": 0, "name": f"step {step}", "ts": us(start),
                    "dur": us(end - start), "args": {"scheduled": s["scheduled"]}})
        out.append({"ph": "C", "pid": 1, "name": "KV blocks", "ts": us(start), "args": {
            "used": s["kv_used"], "cached": s["kv_cached"], "free": s["kv_free"] - s["kv_cached"]}})
        out.append({"ph": "C", "pid": 1, "name": "tokens", "ts": us(start), "args": {
            "prefill": s["num_prefill_tokens"], "decode": s["num_decode_tokens"]}})
    for tid, r in enumerate(trace.requests.values(), 1):
        out.append({"ph": "M", "pid": 1, "tid": tid, "name": "thread_name",
                    "args": {"name": f"request {r.req}"}})
        for step, kind in r.work.items():
            start, end = trace.spans[step]
            out.append({"ph": "X", "pid": 1, "tid": tid, "name": kind, "ts": us(start),
                        "dur": us(end - start), "args": {"step": step}})
        marks = [("arrive", r.arrive_t)] + [("preempt", trace.spans[s][0]) for s in r.preempt_steps]
        if r.finish_t is not None:
            marks.append((f"finish ({r.reason})", r.finish_t))
        out += [{"ph": "i", "s": "t", "pid": 1, "tid": tid, "name": name, "ts": us(t)}
                for name, t in marks]
    return {"traceEvents": out, "displayTimeUnit": "ms"}
