"""bench_serve.py: `nanoserve bench --serve`, a load generator for any OpenAI-compatible server
(nanoserve's, vLLM's, ...), measuring what its users feel: latency per request and throughput.

    nanoserve serve --dtype bfloat16 &                 # or any OpenAI-compatible server
    nanoserve bench --serve --request-rate 2 --num-prompts 48 --plot cdf.png
    nanoserve bench --serve --base-url http://host:8000 --random-input-len 1024 \
        --random-output-len 128 --random-range-ratio 0.5 --slo-ttft-ms 500 --slo-itl-ms 50

Requests arrive as a Poisson process at `--request-rate` per second (inf: all at once); each is
a streamed POST /v1/completions whose prompt is a list of token ids, so its length is exact on
any server and the client needs no tokenizer (ids are drawn from [0, PROMPT_VOCAB), which every
vocabulary has; a token costs the same whatever its id). Greedy and ignore_eos by default, so
each request produces exactly its max_tokens. Lengths are uniform in [MIN, MAX] (--input-len,
--output-len), or vLLM's way: --random-input-len L with --random-range-ratio r is uniform in
[floor(L(1-r)), ceil(L(1+r))].

The definitions are `vllm bench serve`'s, so the two report the same thing for the same run:
- TTFT: from sending the request to the first SSE chunk that carries a choice (its text may be
  empty). E2E: from sending to the last chunk that carries a choice.
- ITL: the gaps between consecutive chunks that carry a choice, pooled over all requests (a
  chunk holding several tokens is one gap). TPOT, per request: (E2E - TTFT) / (tokens - 1).
- Output tokens: the server's `usage.completion_tokens` (stream_options.include_usage); a
  server that sends no usage gets one token per chunk.
- Percentiles: linear interpolation between closest ranks (numpy.percentile's default).
- Throughput: successful requests' output tokens (and requests) / the benchmark's wall time.
- Goodput: successful requests per second with TTFT <= --slo-ttft-ms and TPOT <= --slo-itl-ms
  (vLLM's `--goodput ttft:X tpot:Y`; TPOT is the request's mean ITL per token).
- Arrivals: exponential gaps from the seed, the first request at 0 (vLLM also rescales the gaps
  to sum to N / rate; not here, so the arrivals stay a Poisson process).
- Failed: an HTTP error status, a refused connection, an error event in the stream, or a
  stream that ends before `data: [DONE]`. Failures are counted and listed, never raised.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import os
import random
import time
from typing import Optional

PROMPT_VOCAB = 1000      # ids in [0, 1000): nanoserve-tiny, the smallest model here, has 1479
PERCENTILES = (50, 90, 99)


@dataclasses.dataclass
class RequestResult:
    """One request as the client saw it; times in seconds."""
    prompt_len: int
    max_tokens: int
    start: float = 0.0                  # when it was sent, since the benchmark began
    ttft: Optional[float] = None
    itl: list[float] = dataclasses.field(default_factory=list)
    e2e: Optional[float] = None
    output_tokens: int = 0
    error: Optional[str] = None         # None: it succeeded


# -- the workload -----------------------------------------------------------------------------
def length_range(length: int, range_ratio: float) -> tuple[int, int]:
    """vLLM's --random-*-len with --random-range-ratio r: [floor(L(1-r)), ceil(L(1+r))]."""
    if not 0 <= range_ratio < 1:
        raise ValueError(f"random_range_ratio must be in [0, 1) (got {range_ratio})")
    low, high = math.floor(length * (1 - range_ratio)), math.ceil(length * (1 + range_ratio))
    return max(1, low), max(1, high)


def make_requests(num_prompts: int, input_len=(32, 512), output_len=(32, 256), seed: int = 0,
                  vocab_size: int = PROMPT_VOCAB) -> tuple[list[list[int]], list[int]]:
    """(prompts as token id lists, max_tokens of each), lengths uniform in the given ranges:
    `nanoserve bench`'s workload, checked first (bad flags get an error naming them)."""
    from nanoserve.tools.bench import make_workload
    for name, (low, high) in (("input_len", input_len), ("output_len", output_len)):
        if not 1 <= low <= high:
            raise ValueError(f"{name} must be 1 <= MIN <= MAX (got {low}, {high})")
    if num_prompts < 1:
        raise ValueError(f"num_prompts must be >= 1 (got {num_prompts})")
    return make_workload(num_prompts, input_len, output_len, vocab_size, seed)


def arrival_times(num_prompts: int, request_rate: float, seed: int = 0) -> list[float]:
    """Send times (s): a Poisson process at `request_rate`, the first at 0; inf: all at 0."""
    if not request_rate > 0:
        raise ValueError(f"request_rate must be > 0 or inf (got {request_rate})")
    if math.isinf(request_rate):
        return [0.0] * num_prompts
    rng, t, times = random.Random(seed + 1), 0.0, []   # apart from the prompts' stream
    for _ in range(num_prompts):
        times.append(t)
        t += rng.expovariate(request_rate)
    return times


# -- the client -------------------------------------------------------------------------------
def _error_message(status: int, body: bytes) -> str:
    try:
        return f"HTTP {status}: {json.loads(body)['error']['message']}"
    except (ValueError, KeyError, TypeError):      # not OpenAI's error JSON
        return f"HTTP {status}: {body[:200].decode(errors='replace')}"


async def send(client, url: str, payload: dict, result: RequestResult, t0: float) -> None:
    """Stream one completion into `result`; any failure becomes `result.error`."""
    start = time.perf_counter()
    result.start, last, chunks, done = start - t0, start, 0, False
    try:
        async with client.stream("POST", url, json=payload) as response:
            if response.status_code != 200:
                result.error = _error_message(response.status_code, await response.aread())
                return
            async for line in response.aiter_lines():
                if not line.startswith("data:"):            # blank separators, ": pings"
                    continue
                data = line[len("data:"):].strip()
                if data == "[DONE]":
                    done = True
                    break
                event, now = json.loads(data), time.perf_counter()
                if "error" in event:                         # the status line was already 200
                    error = event["error"]
                    if isinstance(error, dict):              # OpenAI's shape
                        error = error.get("message", error)
                    result.error = f"error event: {error}"
                    return
                if event.get("choices"):
                    if result.ttft is None:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last, chunks = now, chunks + 1
                elif event.get("usage"):
                    result.output_tokens = event["usage"]["completion_tokens"]
    except Exception as e:   # refused, reset, cut mid-stream, bad JSON: a failed request, not run
        result.error = f"{type(e).__name__}: {e}"
        return
    if not done:
        result.error = "the stream ended before data: [DONE]"
    elif result.ttft is None:
        result.error = "the stream had no completion chunk"
    else:
        result.e2e, result.output_tokens = last - start, result.output_tokens or chunks


def served_model(base_url: str, api_key: Optional[str] = None) -> str:
    """The first model the server lists at /v1/models."""
    import httpx
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        response = httpx.get(f"{base_url}/v1/models", headers=headers, timeout=30)
        response.raise_for_status()
        return response.json()["data"][0]["id"]
    except (httpx.HTTPError, ValueError, KeyError, IndexError) as e:
        raise ValueError(f"could not read the model name from {base_url}/v1/models ({e}); "
                         "pass --model") from None


async def run(base_url: str, model: str, prompts: list[list[int]], output_lens: list[int],
              request_rate: float = math.inf, seed: int = 0, temperature: float = 0.0,
              ignore_eos: bool = True, api_key: Optional[str] = None, num_warmups: int = 1,
              progress: bool = True) -> tuple[list[RequestResult], float]:
    """Send every request at its arrival time; (results in request order, wall time in s).
    `num_warmups` short requests go first, off the clock (a server's first call may set up)."""
    import httpx
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    url = f"{base_url}/v1/completions"
    payloads = [{"model": model, "prompt": p, "max_tokens": n, "temperature": temperature,
                 "ignore_eos": ignore_eos, "stream": True,
                 "stream_options": {"include_usage": True}}
                for p, n in zip(prompts, output_lens)]
    results = [RequestResult(len(p), n) for p, n in zip(prompts, output_lens)]
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    # No pool limit (arrivals must not queue in the client), and no overall timeout: a loaded
    # server may take minutes; 10 minutes without a byte is a failure.
    async with httpx.AsyncClient(headers=headers, timeout=httpx.Timeout(600, connect=30),
                                 limits=httpx.Limits(max_connections=None)) as client:
        for _ in range(num_warmups):
            warm = RequestResult(3, 4)
            await send(client, url, {**payloads[0], "prompt": [1, 2, 3], "max_tokens": 4}, warm, 0)
            if warm.error:
                print(f"warm-up request failed: {warm.error}")
        with Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                      TextColumn("{task.fields[failed]} failed"), TimeElapsedColumn(),
                      disable=not progress) as bar:
            task = bar.add_task(f"{model} @ {request_rate} req/s", total=len(payloads), failed=0)

            async def one(i: int, at: float) -> None:
                await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
                await send(client, url, payloads[i], results[i], t0)
                bar.update(task, advance=1, failed=sum(r.error is not None for r in results))
            t0 = time.perf_counter()
            await asyncio.gather(*(one(i, at) for i, at in
                                   enumerate(arrival_times(len(payloads), request_rate, seed))))
            duration = time.perf_counter() - t0
    return results, duration


# -- the metrics ------------------------------------------------------------------------------
def percentile(values: list[float], p: float) -> Optional[float]:
    """The p-th percentile, interpolating linearly between closest ranks (numpy's default):
    rank h = (n - 1) p / 100 in the sorted values. None for no values."""
    if not values:
        return None
    xs = sorted(values)
    h = (len(xs) - 1) * p / 100
    lo = math.floor(h)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (h - lo) * (xs[hi] - xs[lo])


def summarize_ms(values: list[float]) -> dict:
    """Mean and percentiles, seconds in, milliseconds out (None where there are no values)."""
    ms = [1e3 * v for v in values]
    return {"mean": sum(ms) / len(ms) if ms else None,
            **{f"p{p}": percentile(ms, p) for p in PERCENTILES}}


def tokens_per_second(results: list[RequestResult], duration: float) -> list[float]:
    """Output tokens received in each second of the run (a chunk's tokens are the request's
    tokens shared evenly over its chunks, when a server packs several into one)."""
    buckets = [0.0] * max(1, math.ceil(duration))
    for r in results:
        if r.error is None:
            t, weight = r.start + r.ttft, r.output_tokens / (len(r.itl) + 1)
            for gap in [0.0] + r.itl:
                t += gap
                buckets[min(int(t), len(buckets) - 1)] += weight
    return buckets


def compute_metrics(results: list[RequestResult], duration: float,
                    slo_ttft_ms: Optional[float] = None,
                    slo_itl_ms: Optional[float] = None) -> dict:
    """The benchmark's report as a dict (what --save-result writes, with `requests`)."""
    ok = [r for r in results if r.error is None]
    tpot = {id(r): (r.e2e - r.ttft) / (r.output_tokens - 1) if r.output_tokens > 1 else 0.0
            for r in ok}
    good = [r for r in ok if (slo_ttft_ms is None or 1e3 * r.ttft <= slo_ttft_ms)
            and (slo_itl_ms is None or 1e3 * tpot[id(r)] <= slo_itl_ms)]
    output_tokens, input_tokens = sum(r.output_tokens for r in ok), sum(r.prompt_len for r in ok)
    per_second = tokens_per_second(results, duration)
    return {
        "completed": len(ok), "failed": len(results) - len(ok),
        "errors": [r.error for r in results if r.error is not None][:5],
        "duration_s": duration, "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(ok) / duration, "output_throughput": output_tokens / duration,
        "total_token_throughput": (input_tokens + output_tokens) / duration,
        "peak_output_throughput": max(per_second),
        "request_goodput": (len(good) / duration if slo_ttft_ms is not None or
                            slo_itl_ms is not None else None),
        "slo_ttft_ms": slo_ttft_ms, "slo_itl_ms": slo_itl_ms,
        "ttft_ms": summarize_ms([r.ttft for r in ok]),
        "tpot_ms": summarize_ms([t for r in ok if r.output_tokens > 1 for t in [tpot[id(r)]]]),
        "itl_ms": summarize_ms([gap for r in ok for gap in r.itl]),
        "e2e_ms": summarize_ms([r.e2e for r in ok]),
        "output_tokens_per_second": per_second,
    }


def print_report(metrics: dict, title: str) -> None:
    from rich.console import Console
    from rich.table import Table
    m, console = metrics, Console()
    table = Table(title=title)
    table.add_column("metric")
    table.add_column("value", justify="right")
    rows = [("successful / failed requests", f"{m['completed']} / {m['failed']}"),
            ("duration", f"{m['duration_s']:.2f} s"),
            ("input / output tokens", f"{m['total_input_tokens']} / {m['total_output_tokens']}"),
            ("request throughput", f"{m['request_throughput']:.2f} req/s"),
            ("output token throughput", f"{m['output_throughput']:.1f} tok/s"),
            ("total token throughput", f"{m['total_token_throughput']:.1f} tok/s"),
            ("peak output tokens in one second", f"{m['peak_output_throughput']:.0f}")]
    if m["request_goodput"] is not None:
        rows.append((f"goodput (TTFT <= {m['slo_ttft_ms']} ms, TPOT <= {m['slo_itl_ms']} ms)",
                     f"{m['request_goodput']:.2f} req/s"))
    for row in rows:
        table.add_row(*row)
    console.print(table)
    lat = Table(title="latency (ms)")
    lat.add_column("")
    for col in ("mean", *(f"p{p}" for p in PERCENTILES)):
        lat.add_column(col, justify="right")
    for name in ("ttft", "tpot", "itl", "e2e"):
        values = m[f"{name}_ms"].values()
        lat.add_row(name.upper(), *("-" if v is None else f"{v:,.1f}" for v in values))
    console.print(lat)
    for i, error in enumerate(m["errors"]):
        console.print(f"[red]error {i}:[/] {error}", soft_wrap=True)


def plot_runs(runs: dict[str, tuple[list[RequestResult], dict]], path: str) -> None:
    """One figure: TTFT, ITL and E2E CDFs and output tokens/s over time, a line per run
    (label -> (results, metrics)), so two servers under one load share the axes."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    for label, (results, metrics) in runs.items():
        ok = [r for r in results if r.error is None]
        samples = {"TTFT": [r.ttft for r in ok], "ITL": [g for r in ok for g in r.itl],
                   "E2E": [r.e2e for r in ok]}
        for ax, (name, values) in zip(axes.flat, samples.items()):
            xs = sorted(1e3 * v for v in values)
            ax.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], label=label)
            ax.set(xscale="log", xlabel=f"{name} (ms)", ylabel="fraction of samples",
                   title=f"{name} CDF")
        per_second = metrics["output_tokens_per_second"]
        axes[1, 1].stairs(per_second, range(len(per_second) + 1), label=label)
    axes[1, 1].set(xlabel="time since the first request (s)", ylabel="output tokens/s",
                   title="output tokens per second")
    for ax in axes.flat:
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(base_url: str = "http://127.0.0.1:8000", model: Optional[str] = None,
         num_prompts: int = 64, input_len=(32, 512), output_len=(32, 256),
         random_input_len: Optional[int] = None, random_output_len: Optional[int] = None,
         random_range_ratio: float = 0.0, request_rate: float = math.inf, seed: int = 0,
         temperature: float = 0.0, ignore_eos: bool = True, slo_ttft_ms: Optional[float] = None,
         slo_itl_ms: Optional[float] = None, plot: Optional[str] = None,
         save_result: Optional[str] = None, num_warmups: int = 1, progress: bool = True) -> dict:
    """The whole benchmark (parameters: the CLI's flags): workload, run, report, optional
    figure and JSON; returns the metrics. random_*_len, when given, win over *_len ranges."""
    if random_input_len:
        input_len = length_range(random_input_len, random_range_ratio)
    if random_output_len:
        output_len = length_range(random_output_len, random_range_ratio)
    base_url = base_url.rstrip("/").removesuffix("/v1")
    api_key = os.environ.get("OPENAI_API_KEY")
    model = model or served_model(base_url, api_key)
    prompts, output_lens = make_requests(num_prompts, tuple(input_len), tuple(output_len), seed)
    results, duration = asyncio.run(run(base_url, model, prompts, output_lens, request_rate, seed,
                                        temperature, ignore_eos, api_key, num_warmups, progress))
    metrics = compute_metrics(results, duration, slo_ttft_ms, slo_itl_ms)
    print_report(metrics, f"nanoserve bench --serve: {model} at {base_url}, {num_prompts} "
                          f"requests, {request_rate} req/s")
    if plot:
        plot_runs({model: (results, metrics)}, plot)
    if save_result:
        with open(save_result, "w") as f:
            json.dump({"base_url": base_url, "model": model,   # (strict JSON has no Infinity)
                       "request_rate": request_rate if math.isfinite(request_rate) else "inf",
                       **metrics, "requests": [dataclasses.asdict(r) for r in results]},
                      f, indent=1)
    return metrics
