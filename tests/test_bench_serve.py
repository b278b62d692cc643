"""The serving benchmark client (`nanoserve bench --serve`): its arithmetic against cases worked
by hand, and the client against the project's own server on the built-in model (on a free
loopback port), against servers that fail in each way a server can, and against a closed port.

    python -m pytest -q tests/test_bench_serve.py
"""

import asyncio
import json
import math
import re
import socket

import pytest

from nanoserve import AsyncLLM
from nanoserve.tools import bench_serve as bs
from nanoserve.cli import main as cli_main
from test_api import serve

MODEL = "nanoserve-tiny"


def test_percentile_matches_hand_computed_ranks():
    # rank h = (n - 1) p / 100 in the sorted values, interpolated: [1, 2, 3, 4] at p90 is
    # h = 2.7, between 3 and 4 -> 3.7. Input order must not matter.
    assert bs.percentile([4, 1, 3, 2], 50) == 2.5
    assert bs.percentile([4, 1, 3, 2], 90) == pytest.approx(3.7)
    assert bs.percentile([4, 1, 3, 2], 99) == pytest.approx(3.97)
    assert bs.percentile([4, 1, 3, 2], 0) == 1 and bs.percentile([4, 1, 3, 2], 100) == 4
    assert bs.percentile([10, 0], 25) == 2.5
    assert bs.percentile([7.0], 99) == 7.0
    assert bs.percentile(list(range(101)), 99) == 99     # 0..100: the p-th value is p
    assert bs.percentile([], 50) is None


def test_metrics_of_hand_made_results():
    # Two successes and a failure over 2 s. a: TTFT 0.1, chunks 0.2 apart, 4 tokens -> E2E 0.7,
    # TPOT (0.7 - 0.1) / 3 = 0.2. b: TTFT 0.3, 3 tokens in 2 chunks (gap 0.5) -> TPOT 0.25.
    a = bs.RequestResult(10, 4, start=0.0, ttft=0.1, itl=[0.2, 0.2, 0.2], e2e=0.7, output_tokens=4)
    b = bs.RequestResult(20, 3, start=1.0, ttft=0.3, itl=[0.5], e2e=0.8, output_tokens=3)
    failed = bs.RequestResult(30, 5, start=0.5, error="HTTP 400: too long")
    m = bs.compute_metrics([a, failed, b], 2.0, slo_ttft_ms=200, slo_itl_ms=300)
    assert (m["completed"], m["failed"], m["errors"]) == (2, 1, ["HTTP 400: too long"])
    assert (m["total_input_tokens"], m["total_output_tokens"]) == (30, 7)
    assert m["request_throughput"] == 1.0 and m["output_throughput"] == 3.5
    assert m["total_token_throughput"] == 18.5
    assert m["request_goodput"] == 0.5                   # b's TTFT (300 ms) misses the SLO
    assert m["ttft_ms"]["mean"] == pytest.approx(200) and m["ttft_ms"]["p50"] == pytest.approx(200)
    assert m["ttft_ms"]["p90"] == pytest.approx(280)     # 100 + 0.9 * (300 - 100)
    assert m["tpot_ms"]["p50"] == pytest.approx(225)
    # ITL pools every gap of every request: [200, 200, 200, 500]
    assert m["itl_ms"]["mean"] == pytest.approx(275) and m["itl_ms"]["p50"] == pytest.approx(200)
    assert m["itl_ms"]["p99"] == pytest.approx(491)      # h = 2.97: 200 + 0.97 * 300
    assert m["e2e_ms"]["p50"] == pytest.approx(750)
    # tokens by the second they arrived: a's 4 at 0.1..0.7; b's 3 (1.5 per chunk) at 1.3, 1.8
    assert m["output_tokens_per_second"] == pytest.approx([4.0, 3.0])
    assert bs.compute_metrics([a, b], 2.0)["request_goodput"] is None   # no SLO, no goodput
    assert bs.compute_metrics([a, b], 2.0, slo_itl_ms=210)["request_goodput"] == 0.5


def test_workload_lengths_ids_and_arrivals():
    prompts, outs = bs.make_requests(200, (32, 64), (8, 16), seed=3)
    assert all(32 <= len(p) <= 64 for p in prompts) and all(8 <= n <= 16 for n in outs)
    assert {len(p) for p in prompts} >= {32, 64}         # both ends are reachable
    assert all(0 <= t < bs.PROMPT_VOCAB for p in prompts for t in p)
    assert bs.make_requests(200, (32, 64), (8, 16), seed=3) == (prompts, outs)
    assert bs.length_range(100, 0.5) == (50, 150) and bs.length_range(64, 0.0) == (64, 64)
    with pytest.raises(ValueError, match="random_range_ratio"):
        bs.length_range(100, 1.0)
    assert bs.arrival_times(5, math.inf) == [0.0] * 5
    times = bs.arrival_times(20000, 4.0)
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert times[0] == 0 and min(gaps) >= 0
    assert sum(gaps) / len(gaps) == pytest.approx(0.25, rel=0.03)       # mean gap 1 / rate
    # exponential gaps: P(gap > mean) = 1/e
    assert sum(g > 0.25 for g in gaps) / len(gaps) == pytest.approx(math.exp(-1), abs=0.02)


@pytest.fixture(scope="module")
def url():
    with serve(AsyncLLM(), MODEL) as url:
        yield url


def test_client_against_the_builtin_model(url):
    assert bs.served_model(url) == MODEL
    prompts, outs = bs.make_requests(6, (8, 40), (4, 16), seed=1)
    prompts.append([5] * 600)     # over nanoserve-tiny's 512-token context: the server says 400
    outs.append(4)
    results, duration = asyncio.run(bs.run(url, MODEL, prompts, outs, request_rate=50,
                                           progress=False))
    for r, p, n in zip(results[:6], prompts, outs):
        assert r.error is None, r.error
        assert (r.prompt_len, r.output_tokens) == (len(p), n)   # ignore_eos: exactly max_tokens
        assert 0 < r.ttft <= r.e2e <= duration and len(r.itl) <= n - 1
        assert r.e2e == pytest.approx(r.ttft + sum(r.itl))
    assert results[6].error.startswith("HTTP 400") and "max_model_len" in results[6].error
    m = bs.compute_metrics(results, duration)
    assert (m["completed"], m["failed"], m["total_output_tokens"]) == (6, 1, sum(outs[:6]))
    assert sum(m["output_tokens_per_second"]) == pytest.approx(sum(outs[:6]))
    # A model the server does not serve: every request is an HTTP 404, counted, not raised.
    results, _ = asyncio.run(bs.run(url, "no-such-model", prompts[:3], outs[:3], progress=False))
    assert all(r.error.startswith("HTTP 404") and "does not exist" in r.error for r in results)


def test_cli_writes_the_result_and_the_figure(url, tmp_path, capsys):
    result, figure = tmp_path / "result.json", tmp_path / "cdf.png"
    cli_main(["bench", "--serve", "--base-url", url + "/v1", "--num-prompts", "4",
              "--request-rate", "20", "--random-input-len", "24", "--random-output-len", "8",
              "--random-range-ratio", "0.5", "--slo-ttft-ms", "60000", "--slo-itl-ms", "60000",
              "--plot", str(figure), "--save-result", str(result)])
    saved = json.loads(result.read_text())
    assert (saved["model"], saved["completed"], saved["failed"]) == (MODEL, 4, 0)
    assert saved["request_goodput"] == pytest.approx(saved["request_throughput"])
    assert all(12 <= r["prompt_len"] <= 36 and 4 <= r["max_tokens"] <= 12
               and r["output_tokens"] == r["max_tokens"] for r in saved["requests"])
    assert saved["total_output_tokens"] == sum(r["max_tokens"] for r in saved["requests"])
    assert figure.stat().st_size > 10_000
    assert "output token throughput" in capsys.readouterr().out


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


SSE_HEAD = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
            b"transfer-encoding: chunked\r\n\r\n")
TOKEN = _chunk(b'data: {"choices": [{"index": 0, "text": " a"}]}\n\n')
BROKEN = {   # raw HTTP answers, and what the client must report for each
    "cut mid-stream": (SSE_HEAD + TOKEN, "RemoteProtocolError"),
    "no [DONE]": (SSE_HEAD + TOKEN + b"0\r\n\r\n", "ended before data: [DONE]"),
    "error event": (SSE_HEAD + TOKEN + _chunk(b'data: {"error": {"message": "step failed"}}\n\n')
                    + _chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n", "error event: step failed"),
    "500": (b"HTTP/1.1 500 Internal Server Error\r\ncontent-type: application/json\r\n"
            b"content-length: 31\r\n\r\n" + b'{"error": {"message": "oh no"}}', "HTTP 500: oh no"),
}


@pytest.mark.parametrize("case", BROKEN)
def test_broken_servers_are_counted_not_raised(case):
    raw, expected = BROKEN[case]

    async def handle(reader, writer):
        head = await reader.readuntil(b"\r\n\r\n")
        await reader.readexactly(int(re.search(rb"content-length: (\d+)", head, re.I).group(1)))
        writer.write(raw)
        await writer.drain()
        writer.close()

    async def bench():
        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        async with server:
            port = server.sockets[0].getsockname()[1]
            return await bs.run(f"http://127.0.0.1:{port}", "m", [[1, 2, 3]] * 3, [4] * 3,
                                num_warmups=0, progress=False)
    results, duration = asyncio.run(bench())
    assert all(expected in r.error for r in results), [r.error for r in results]
    m = bs.compute_metrics(results, duration)
    assert (m["completed"], m["failed"], m["output_throughput"]) == (0, 3, 0.0)
    assert m["ttft_ms"]["p50"] is None and len(m["errors"]) == 3


def test_closed_port_is_counted_not_raised(capsys):
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()                                   # nothing listens there now
    m = bs.main(f"http://127.0.0.1:{port}", model="m", num_prompts=3, input_len=(4, 4),
                output_len=(2, 2), progress=False)
    assert (m["completed"], m["failed"]) == (0, 3)
    assert all(e.startswith("ConnectError") for e in m["errors"])
    out = capsys.readouterr().out
    assert "warm-up request failed" in out and "0 / 3" in out
    with pytest.raises(ValueError, match="pass --model"):   # no server to name the model
        bs.main(f"http://127.0.0.1:{port}", num_prompts=1, progress=False)
