"""soak.py: a long, rough run against `nanoserve serve`; afterwards nothing may be lost, hung,
leaked or answered with a 500.

    python scripts/soak.py                                  # 1,000 requests, 200 clients
    python scripts/soak.py --requests 60 --concurrency 20   # the short run tests/test_soak.py does

It starts the server on the built-in model with `--debug 2` (the KV cache invariants are asserted
after every step: a broken one fails that step's requests, which this run then counts) and sends
streamed and plain /v1/completions and /v1/chat/completions requests with mixed n, stop strings,
seeds and logprobs, from `--concurrency` clients at once. 20% of the clients hang up at a random
point of their stream; 5% send malformed or out-of-range bodies (which must get a 4xx); and
`--attack-fraction` (10%) are attackers, each sending one of ATTACKS (the probes of
tests/test_security_*.py: a seed past int64, a 50,000-value enum, a body nested 5,000 deep, NaN,
a text/plain POST, a foreign Host header, a 7.8 MB prompt, 300k stop strings, 12,800 sequences
in one request) while the honest clients stream beside them; every attack also runs once before
memory is sampled, since the largest bodies raise the allocators' high-water mark once, which is
no leak. Then:

- lost: an accepted request that did not finish (must be 0); an error event also counts, as
  no fault is injected here; a malformed body that is not refused with a 4xx counts too;
- hung: a request with no answer within --request-timeout-s (must be 0);
- attack_accepted: an attack that was not refused with a 4xx (must be 0); attack_answered: the
  one attack that must be answered well (temperature 1e-300 with a grammar: vLLM raises it to
  0.01) and was not;
- 500s: any response with status >= 500 (must be 0);
- after the run, /metrics must show no request running or waiting and the KV cache empty;
- the server's memory (RSS of its whole process tree, sampled every 0.5 s) may grow by at most
  --max-rss-growth-mb between the first and the last quarter of the run.
The exit status is 0 only when every check holds.
"""

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import httpx

from nanoserve.distributed import free_port

sys.path.insert(0, str(Path(__file__).parent))
from compare_serving import running  # noqa: E402  (scripts/ is not a package)

MODEL = "nanoserve-tiny"
BAD_BODIES = [b"{not json", b'{"model": "nanoserve-tiny", "prompt": "x", "max_tokens": -1}',
              b'{"model": "nanoserve-tiny", "prompt": "x", "n": 0}',
              b'{"model": "nanoserve-tiny", "prompt": [999999999], "max_tokens": 4}',
              b'{"model": "nanoserve-tiny", "prompt": "x", "temperature": "hot"}',
              b'{"model": "nanoserve-tiny", "prompt": "x", "max_tokens": 100000000}',
              b'{"model": "nanoserve-tiny", "messages": [{"role": 1}]}']


def _body(**fields) -> bytes:
    return json.dumps({"model": MODEL, "prompt": "Once upon a time", "max_tokens": 4, **fields}).encode()


def _attacks() -> dict:
    """name -> (raw body, extra headers, whether the server must answer it well rather than
    refuse it with a 4xx). Built once: some bodies are megabytes."""
    enum = {"type": "json_schema", "json_schema": {"name": "e", "schema": {
        "type": "object", "properties": {"k": {"enum": [f"v{i}" for i in range(50_000)]}}}}}
    return {
        "seed_past_int64": (_body(seed=2**64), {}, False),
        "tiny_temperature_grammar": (_body(temperature=1e-300, structured_outputs={
            "choice": ["yes", "no"]}), {}, True),
        "huge_enum": (_body(response_format=enum), {}, False),
        "deep_nesting": (b'{"model": "nanoserve-tiny", "prompt": "x", "user": ' + b"[" * 5000
                         + b"]" * 5000 + b"}", {}, False),
        "nan": (_body(repetition_penalty=float("nan")), {}, False),
        "text_plain": (_body(), {"content-type": "text/plain"}, False),
        "foreign_host": (_body(), {"host": "evil.example"}, False),
        "huge_prompt": (_body(prompt="a " * 3_900_000), {}, False),
        "many_stops": (_body(stop=[f"s{i}" for i in range(300_000)]), {}, False),
        "many_sequences": (_body(prompt=[[1, 2, 3]] * 100, n=128), {}, False),
    }


ATTACKS = _attacks()


def attack_job(name: str) -> dict:
    raw, headers, answer = ATTACKS[name]
    return {"kind": "attack", "name": name, "chat": False, "raw": raw, "headers": headers,
            "answer": answer}


def make_job(rng: random.Random, attack_fraction: float = 0.0) -> dict:
    """One client's request: what to send and whether to hang up (after how many events)."""
    roll = rng.random()
    if roll < attack_fraction:
        return attack_job(rng.choice(sorted(ATTACKS)))
    if roll < attack_fraction + 0.05:
        chat = rng.random() < 0.5
        return {"kind": "bad", "chat": chat, "raw": rng.choice(BAD_BODIES)}
    chat = rng.random() < 0.5
    body = {"model": MODEL, "max_tokens": rng.randint(1, 48), "n": rng.choice([1, 1, 2, 3]),
            "temperature": rng.choice([0.0, 0.7, 1.0]), "stream": rng.random() < 0.8}
    if chat:
        body["messages"] = [{"role": "user", "content": f"Tell me a story about a {rng.choice(['cat', 'owl', 'fox'])}."}]
    else:
        body["prompt"] = rng.choice(["Once upon a time", "The little dog", "A bird sang"])
    if rng.random() < 0.3:
        body["stop"] = rng.choice([["."], [" the", "!"], "and"])
    if rng.random() < 0.3:
        body["seed"] = rng.randrange(2**31)
    if rng.random() < 0.2:
        body.update({"logprobs": True, "top_logprobs": 2} if chat else {"logprobs": 2})
    hang_up = rng.random() < 0.20 and body["stream"]
    return {"kind": "hang_up" if hang_up else "normal", "chat": chat, "body": body,
            "after_events": rng.randint(0, 6)}


async def run_job(client: httpx.AsyncClient, job: dict, timeout: float) -> str:
    """The outcome: finished, error_event, rejected (4xx), hung_up, hung, 500, lost; for an
    attack: attack_refused (4xx), attack_answered (the one it must answer), attack_accepted."""
    try:
        return await asyncio.wait_for(exchange(client, job), timeout)
    except asyncio.TimeoutError:
        return "hung"
    except httpx.HTTPError:
        return "lost"


async def exchange(client: httpx.AsyncClient, job: dict) -> str:
    path = "/v1/chat/completions" if job["chat"] else "/v1/completions"
    content = job.get("raw") or json.dumps(job["body"]).encode()
    headers = {"content-type": "application/json", **job.get("headers", {})}
    async with client.stream("POST", path, content=content, headers=headers) as response:
        if response.status_code >= 500:
            return "500"
        if job["kind"] == "attack":
            body = await response.aread()
            if job["answer"]:
                answered = response.status_code == 200 and all(
                    c["finish_reason"] for c in json.loads(body)["choices"])
                return "attack_answered" if answered else "attack_failed"
            return "attack_refused" if response.status_code >= 400 else "attack_accepted"
        if response.status_code >= 400:
            await response.aread()
            return "rejected" if job["kind"] == "bad" else "lost"
        if job["kind"] == "bad":
            return "bad_accepted"
        if not job["body"].get("stream"):
            choices = json.loads(await response.aread())["choices"]
            return "finished" if all(c["finish_reason"] for c in choices) else "lost"
        events, finished = 0, set()
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                n = job["body"]["n"]
                return "finished" if len(finished) == n else "lost"
            event = json.loads(line[6:])
            if "error" in event:
                return "error_event"
            finished |= {c["index"] for c in event["choices"] if c.get("finish_reason")}
            events += 1
            if job["kind"] == "hang_up" and events > job["after_events"]:
                return "hung_up"   # leaving the block closes the connection mid-stream
        return "lost"              # the stream ended without [DONE]


def tree_rss_mb(pid: int) -> float:
    """Resident memory of a process and all its descendants, in MiB (Linux /proc)."""
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        try:
            status = Path(f"/proc/{p}/status").read_text()
            total += int(next(line for line in status.splitlines() if line.startswith("VmRSS")).split()[1])
            for task in Path(f"/proc/{p}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except (OSError, StopIteration):
            continue
    return total / 1024


async def soak(url: str, server_pid: int, requests: int, concurrency: int, seed: int,
               timeout: float, attack_fraction: float) -> dict:
    rng = random.Random(seed)
    jobs = [make_job(rng, attack_fraction) for _ in range(requests)]
    outcomes, rss = Counter(), []
    queue = asyncio.Queue()
    for job in jobs:
        queue.put_nowait(job)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=None, limits=limits) as client:
        # Every attack once before memory is sampled: the largest bodies (8 MiB) raise the
        # allocators' high-water marks once, for good, which is no leak; what grows after is.
        if attack_fraction:
            for outcome in await asyncio.gather(*(run_job(client, attack_job(name), timeout)
                                                  for name in ATTACKS)):
                outcomes[outcome] += 1

        async def worker():
            while not queue.empty():
                outcomes[await run_job(client, queue.get_nowait(), timeout)] += 1

        async def sample():
            while True:
                rss.append(tree_rss_mb(server_pid))
                await asyncio.sleep(0.5)
        sampler = asyncio.create_task(sample())
        start = time.monotonic()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        elapsed = time.monotonic() - start
        sampler.cancel()
        stats = await settled_stats(client)
    quarter = max(1, len(rss) // 4)
    return {"requests": requests, "concurrency": concurrency, "elapsed_s": round(elapsed, 1),
            "outcomes": dict(outcomes), "after": stats,
            "rss_first_quarter_mb": round(statistics.mean(rss[:quarter]), 1),
            "rss_last_quarter_mb": round(statistics.mean(rss[-quarter:]), 1)}


async def settled_stats(client: httpx.AsyncClient, wait_s: float = 15.0) -> dict:
    """The engine's gauges once it has processed the last aborts (polled up to wait_s)."""
    deadline = time.monotonic() + wait_s
    while True:
        text = (await client.get("/metrics")).text
        stats = {line.split()[0].removeprefix("nanoserve:"): float(line.split()[1])
                 for line in text.splitlines()
                 if line.startswith(("nanoserve:num_requests", "nanoserve:kv_cache_usage"))}
        if not any(stats.values()) or time.monotonic() > deadline:
            return stats
        await asyncio.sleep(0.2)


def failures(report: dict, max_rss_growth_mb: float) -> list[str]:
    out = report["outcomes"]
    # error_event: nothing here injects faults, so an error event means a step failed (e.g. a
    # KV invariant that --debug 2 asserts).
    problems = [f"{out[k]} {k}" for k in ("lost", "hung", "500", "error_event", "bad_accepted",
                                          "attack_accepted", "attack_failed") if out.get(k)]
    problems += [f"{k} = {v} after the run" for k, v in report["after"].items() if v]
    growth = report["rss_last_quarter_mb"] - report["rss_first_quarter_mb"]
    if growth > max_rss_growth_mb:
        problems.append(f"RSS grew {growth:.0f} MiB (bound {max_rss_growth_mb})")
    return problems


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--concurrency", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--request-timeout-s", type=float, default=300.0)
    parser.add_argument("--max-rss-growth-mb", type=float, default=64.0)
    parser.add_argument("--attack-fraction", type=float, default=0.1,
                        help="share of the clients that send one of ATTACKS")
    parser.add_argument("--server-args", default="", help="extra flags for nanoserve serve")
    args = parser.parse_args(argv)
    port = free_port()
    cmd = [sys.executable, "-m", "nanoserve.cli", "serve", "--port", str(port), "--debug", "2",
           "--max-model-len", "512", *args.server_args.split()]
    with tempfile.TemporaryDirectory() as logs, \
            running("nanoserve", cmd, dict(os.environ), port, logs, timeout=120) as (url, pid):
        report = asyncio.run(soak(url, pid, args.requests, args.concurrency, args.seed,
                                  args.request_timeout_s, args.attack_fraction))
    problems = failures(report, args.max_rss_growth_mb)
    print(json.dumps(report, indent=1))
    print("soak: " + ("OK" if not problems else "FAILED: " + "; ".join(problems)))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
