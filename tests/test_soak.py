"""The soak run (scripts/soak.py), short: a live `nanoserve serve` on the built-in model with
--debug 2, 60 requests from 20 concurrent clients, some hanging up mid-stream, some malformed,
some attacking (the security probes). Nothing lost, hung or answered with a 500, every attack
refused (or, the one that must be, answered); the engine empty afterwards.

    python -m pytest -q tests/test_soak.py
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
import soak  # noqa: E402


def test_short_soak_passes(capsys):
    assert soak.main(["--requests", "60", "--concurrency", "20", "--request-timeout-s", "120"]) == 0
    printed = capsys.readouterr().out
    assert '"hung_up"' in printed and '"rejected"' in printed and "soak: OK" in printed
    assert '"attack_refused"' in printed


def test_soak_reports_every_kind_of_failure():
    report = {"outcomes": {"finished": 5, "lost": 1, "hung": 2, "500": 1, "error_event": 1,
                           "attack_accepted": 1, "attack_refused": 3},
              "after": {"num_requests_running": 1.0, "kv_cache_usage_perc": 0.0},
              "rss_first_quarter_mb": 100.0, "rss_last_quarter_mb": 300.0}
    problems = soak.failures(report, max_rss_growth_mb=64)
    assert problems == ["1 lost", "2 hung", "1 500", "1 error_event", "1 attack_accepted",
                        "num_requests_running = 1.0 after the run", "RSS grew 200 MiB (bound 64)"]
    clean = {**report, "outcomes": {"finished": 5, "hung_up": 2}, "after": {},
             "rss_last_quarter_mb": 110.0}
    assert soak.failures(clean, max_rss_growth_mb=64) == []


def test_every_malformed_body_is_a_4xx_job():
    import random
    rng = random.Random(0)
    jobs = [soak.make_job(rng, attack_fraction=0.1) for _ in range(400)]
    assert {job["kind"] for job in jobs} == {"bad", "hang_up", "normal", "attack"}
    assert {job["name"] for job in jobs if job["kind"] == "attack"} == set(soak.ATTACKS)
