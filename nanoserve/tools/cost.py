"""cost.py: `nanoserve cost`, serve the model yourself or pay an API per token?

    nanoserve cost --prices examples/prices.json --requests-per-day 100000 \\
        --prompt-tokens 1000 --output-tokens 200 --throughput 1000 --plot cost.png

No price is built in: each comes from a flag or from a prices file with dated figures and
their sources (examples/prices.json); a flag wins over the file. The self-hosted throughput is
the output tokens per second one server sustains on this workload: measure it with
`nanoserve bench` at the same prompt and output lengths, or give it.

The arithmetic, over a 30-day month:

    API          = requests/day x 30 x (prompt x input price + output x output price) / 1e6
    capacity     = throughput / output tokens per request x 86,400 requests/day per server
    self-hosted  = servers x GPUs per server x GPU price/hour x 24 x 30,
                   servers = ceil(requests/day / capacity) (GPUs are paid whether busy or not)
    break-even   = one server's monthly cost / (30 x the API's cost per request)  requests/day
    utilisation  = requests/day / (servers x capacity)

Worked example (the command above with --gpu-price-per-hour 2; the file's API prices are $0.15
and $0.60 per million tokens; 1000 tokens/s is an assumed throughput): an API request costs (1000 x 0.15 + 200 x 0.60) / 1e6 = $0.00027, so $810 a month; the GPU
costs 2.00 x 720 = $1,440. One server handles 1000 / 200 x 86,400 = 432,000 requests/day.
Break-even: 1440 / (30 x 0.00027) = 177,778 requests/day, where the GPU is 41% busy. If a
fully busy server still cost more than the API (break-even above capacity), self-hosting
would never pay: more volume only adds more servers, each at best fully busy.
"""

from __future__ import annotations

import json
import math
from dataclasses import MISSING, dataclass, fields
from pathlib import Path
from typing import Optional

from matplotlib.figure import Figure
from rich.console import Console
from rich.table import Table

DAYS_PER_MONTH = 30
SECONDS_PER_DAY = 86_400


@dataclass(frozen=True)
class CostInputs:
    requests_per_day: float
    prompt_tokens: int            # per request
    output_tokens: int            # per request
    api_input_price: float        # $ per million prompt tokens
    api_output_price: float       # $ per million output tokens
    gpu_price_per_hour: float     # $ per GPU-hour
    throughput: float             # output tokens/s of one self-hosted server on this workload
    gpus_per_server: int = 1

    def __post_init__(self):
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
                raise ValueError(f"{f.name} must be a number (got {value!r})")
            positive = f.name in ("output_tokens", "throughput", "gpus_per_server")
            if value < 0 or (positive and value == 0):
                raise ValueError(f"{f.name} must be {'> 0' if positive else '>= 0'} (got {value})")

    # -- the API: pay per token ------------------------------------------------
    @property
    def api_cost_per_request(self) -> float:
        return (self.prompt_tokens * self.api_input_price
                + self.output_tokens * self.api_output_price) / 1e6

    def api_monthly(self, requests_per_day: Optional[float] = None) -> float:
        volume = self.requests_per_day if requests_per_day is None else requests_per_day
        return volume * DAYS_PER_MONTH * self.api_cost_per_request

    # -- self-hosted: pay per GPU-hour, busy or not -----------------------------
    @property
    def capacity_per_day(self) -> float:
        """Requests per day one server completes when it is never idle."""
        return self.throughput / self.output_tokens * SECONDS_PER_DAY

    @property
    def server_monthly(self) -> float:
        return self.gpus_per_server * self.gpu_price_per_hour * 24 * DAYS_PER_MONTH

    def servers(self, requests_per_day: Optional[float] = None) -> int:
        volume = self.requests_per_day if requests_per_day is None else requests_per_day
        return max(1, math.ceil(volume / self.capacity_per_day))

    def self_hosted_monthly(self, requests_per_day: Optional[float] = None) -> float:
        return self.servers(requests_per_day) * self.server_monthly

    def utilisation(self, requests_per_day: Optional[float] = None) -> float:
        volume = self.requests_per_day if requests_per_day is None else requests_per_day
        return volume / (self.servers(volume) * self.capacity_per_day)

    @property
    def break_even(self) -> Optional[float]:
        """Requests/day at which one server costs what the API does; None when even a fully
        busy server costs more (then no volume makes self-hosting cheaper)."""
        if self.api_cost_per_request == 0:
            return None
        volume = self.server_monthly / (DAYS_PER_MONTH * self.api_cost_per_request)
        return volume if volume <= self.capacity_per_day else None


# Where each price lives in a prices file (see examples/prices.json).
PRICE_KEYS = {"api_input_price": ("api", "input_per_million_tokens"),
              "api_output_price": ("api", "output_per_million_tokens"),
              "gpu_price_per_hour": ("gpu", "per_hour")}


def load_prices(path: str) -> dict:
    """The prices file as a dict: {"api": {...}, "gpu": {...}} (see examples/prices.json)."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"prices: cannot read {path} ({e})") from None
    if not isinstance(data, dict):
        raise ValueError(f"prices: {path} must hold a JSON object with 'api' and 'gpu' entries")
    return data


def cost_inputs(prices: Optional[str] = None, **given) -> tuple[CostInputs, list[str]]:
    """CostInputs from flags (`given`, None where unset) over a prices file's figures, and a
    note saying what, as of when and from where, for each file entry used."""
    data = load_prices(prices) if prices else {}
    values = {k: v for k, v in given.items() if v is not None}
    used = set()
    for name, (section, key) in PRICE_KEYS.items():
        if name not in values and key in data.get(section, {}):
            values[name] = data[section][key]
            used.add(section)
    notes = [f"{section}: {data[section].get('name', '?')}, as of "
             f"{data[section].get('as_of', 'an unknown date')} "
             f"({data[section].get('source', 'no source given')})" for section in sorted(used)]
    missing = [f.name for f in fields(CostInputs) if f.name not in values and f.default is MISSING]
    if missing:
        flags = ", ".join("--" + name.replace("_", "-") for name in missing)
        raise ValueError(f"{', '.join(missing)} missing: pass {flags}"
                         + (" or a --prices file" if set(missing) & set(PRICE_KEYS) else ""))
    return CostInputs(**values), notes


def print_report(c: CostInputs, notes: list[str], console: Optional[Console] = None) -> None:
    table = Table(title=f"nanoserve cost · a {DAYS_PER_MONTH}-day month", show_header=False)
    table.add_column(style="bold")
    table.add_column(justify="right")
    table.add_column(style="dim")
    servers = c.servers()
    rows = [
        ("workload", f"{c.requests_per_day:,.0f} req/day",
         f"{c.prompt_tokens} prompt + {c.output_tokens} output tokens each"),
        ("API", f"${c.api_monthly():,.2f}",
         f"${c.api_cost_per_request:.6f} a request: {c.prompt_tokens} x {_usd(c.api_input_price)}"
         f" + {c.output_tokens} x {_usd(c.api_output_price)} per million"),
        ("self-hosted", f"${c.self_hosted_monthly():,.2f}",
         f"{servers} server(s) x {c.gpus_per_server} GPU(s) x {_usd(c.gpu_price_per_hour)}/h"
         f" x {24 * DAYS_PER_MONTH} h"),
        ("server capacity", f"{c.capacity_per_day:,.0f} req/day",
         f"{c.throughput:,.0f} output tok/s / {c.output_tokens} tokens x {SECONDS_PER_DAY:,} s"),
        ("GPU utilisation", f"{c.utilisation():.1%}", "at this workload"),
    ]
    if c.break_even is None:
        rows.append(("break-even", "never", "a fully busy server costs more than the API"))
    else:
        rows.append(("break-even", f"{c.break_even:,.0f} req/day",
                     f"GPU utilisation there: {c.break_even / c.capacity_per_day:.1%}"))
    for row in rows:
        table.add_row(*row)
    console = console or Console()
    console.print(table)
    cheaper = "self-hosting" if c.self_hosted_monthly() < c.api_monthly() else "the API"
    console.print(f"cheaper at this workload: {cheaper}", style="bold")
    for note in notes:
        console.print(f"prices from the file: {note}", style="dim")


def plot_cost(c: CostInputs, path: str) -> None:
    """Monthly cost of both options against requests/day; the break-even and the workload marked."""
    top = 2.5 * max(c.requests_per_day, c.break_even or c.capacity_per_day, 1.0)
    volumes = [top * i / 400 for i in range(401)]
    fig = Figure(figsize=(8, 4.5), layout="constrained")
    ax = fig.subplots()
    ax.plot(volumes, [c.api_monthly(v) for v in volumes], label="API (pay per token)")
    ax.step(volumes, [c.self_hosted_monthly(v) for v in volumes], where="post",
            label=f"self-hosted ({c.gpus_per_server} GPU(s) per server)")
    if c.break_even is not None:
        ax.axvline(c.break_even, color="grey", linestyle=":",
                   label=f"break-even {c.break_even:,.0f} req/day")
    ax.axvline(c.requests_per_day, color="black", linestyle="--", label="this workload")
    ax.set_xlabel("requests per day")
    ax.set_ylabel("$ per month")
    ax.legend(loc="upper left", fontsize="small")
    fig.savefig(path, dpi=120)


def main(plot: Optional[str] = None, prices: Optional[str] = None, **given) -> None:
    inputs, notes = cost_inputs(prices, **given)
    print_report(inputs, notes)
    if plot:
        plot_cost(inputs, plot)
        print(f"wrote {plot}")


def _usd(x: float) -> str:
    return f"${x:.2f}" if round(x, 2) == x else f"${x:g}"
