"""bench_scheduler.py: how long one scheduler step takes, model excluded.

    python scripts/bench_scheduler.py

With 64, 256 and 1024 requests running (steady decode: every step each request gets one
token, and every block_size steps each needs a new block), it times `schedule()` +
`update()` and prints microseconds per step. The scheduler must stay far below the model's
step time (milliseconds even for tiny models), so the target is < 1 ms at 256 requests.
The "model" returns a constant token, so only the scheduler and KV manager are timed.
"""

import argparse
import statistics
import time

from rich.console import Console
from rich.table import Table

from nanoserve.config import Config
from nanoserve.kv_cache import KVCacheManager
from nanoserve.sampling_params import SamplingParams
from nanoserve.request import Request
from nanoserve.scheduler import Scheduler


def bench(num_running: int, steps: int, prompt_len: int = 128, block_size: int = 16) -> dict:
    max_tokens = steps + 10
    blocks_per_req = -(-(prompt_len + max_tokens) // block_size)
    config = Config(max_num_seqs=num_running, max_num_batched_tokens=num_running * prompt_len,
                    max_model_len=4096, block_size=block_size,
                    num_kv_blocks=num_running * blocks_per_req + 16)
    kv = KVCacheManager(config.num_kv_blocks, block_size, config.enable_prefix_caching)
    sched = Scheduler(config, kv)
    for i in range(num_running):
        # Distinct prompts: no prefix hits, every block is hashed as it fills.
        prompt = [(i * 7919 + j) % 50000 for j in range(prompt_len)]
        sched.add_request(Request(f"r{i}", prompt, SamplingParams(max_tokens=max_tokens,
                                                                  ignore_eos=True)))
    out = sched.schedule()                      # the prefill step, not timed
    sched.update(out, {r.request_id: [1] for r in out.requests})
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        out = sched.schedule()
        sched.update(out, {r.request_id: [1] for r in out.requests})
        times.append(time.perf_counter() - t0)
    assert len(out.requests) == num_running
    return {"median_us": statistics.median(times) * 1e6,
            "p90_us": sorted(times)[int(0.9 * len(times))] * 1e6}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    table = Table(title="scheduler step (schedule + update), fake model")
    for col in ("running requests", "median µs / step", "p90 µs / step", "µs / request"):
        table.add_column(col, justify="right")
    for n in (64, 256, 1024):
        r = bench(n, args.steps)
        table.add_row(str(n), f"{r['median_us']:.0f}", f"{r['p90_us']:.0f}",
                      f"{r['median_us'] / n:.2f}")
    Console().print(table)


if __name__ == "__main__":
    main()
