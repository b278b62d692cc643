"""The OpenAI-compatible server, live on a free loopback port, driven by the official `openai`
client (and httpx for raw bodies and errors). The oracle is the offline `LLM` over the same
tiny checkpoint: whatever the API does to a request, greedy text must come out the same.

    python -m pytest -q tests/test_api.py
"""

import asyncio
import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import openai
import pytest
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from nanoserve import LLM, AsyncLLM, SamplingParams
from nanoserve.api import MAX_BODY_BYTES, build_app
from nanoserve.errors import EngineDeadError

KEY, MODEL = "test-key", "tiny"
CONFIG = dict(max_model_len=256, block_size=16, num_kv_blocks=64, device="cpu")
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")
GREEDY = dict(temperature=0.0, extra_body={"ignore_eos": True})
PROMPTS = ["the quick brown fox", "hello world", "a cat sat", "paged attention keeps"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from transformers import AutoTokenizer

    from conftest import build_checkpoint
    path = tmp_path_factory.mktemp("api_llama")
    build_checkpoint(path, "llama")
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(path)
    engine = AsyncLLM(str(path), **CONFIG)      # the engine core in its own process
    with serve(engine, MODEL, KEY) as url:
        yield SimpleNamespace(url=url, engine=engine, tokenizer=tokenizer, llm=LLM(str(path), **CONFIG),
                              path=str(path), client=openai.OpenAI(base_url=url + "/v1", api_key=KEY,
                                                                   max_retries=0))


@contextlib.contextmanager
def serve(engine, model_name, api_key=None):
    """The app on a free local port, in a thread; yields its base URL."""
    with serve_app(build_app(engine, model_name, api_key=api_key)) as url:
        yield url


@contextlib.contextmanager
def serve_app(app, **options):
    """`app` on a free loopback port, with uvicorn `options` (as `nanoserve serve` passes them)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    uv = uvicorn.Server(uvicorn.Config(app, log_level="warning", **options))
    thread = threading.Thread(target=uv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not uv.started:
        assert time.monotonic() < deadline, "the server did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        uv.should_exit = True
        thread.join(10)


def test_builtin_model_tells_the_story_asked_for():
    """nanoserve-tiny through /v1/chat/completions with the official client, as the README shows:
    the reply is a story whose hero is the animal asked for, and it ends by itself (EOS)."""
    with serve(AsyncLLM(), "nanoserve-tiny") as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="EMPTY", max_retries=0)
        for animal in ("cat", "owl"):
            reply = client.chat.completions.create(
                model="nanoserve-tiny", max_tokens=200, temperature=0.0,
                messages=[{"role": "user", "content": f"Tell me a story about a {animal}."}]).choices[0]
            hero = re.search(r"\ban? (?:\w+ )?(\w+) (?:named|called) [A-Z]", reply.message.content)
            assert hero and hero.group(1) == animal, reply.message.content
            assert reply.finish_reason == "stop", reply


def offline(server, prompt, max_tokens, logprobs=None):
    """The oracle: the offline engine's greedy completion (ignore_eos, as GREEDY asks)."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                            logprobs=logprobs)
    return server.llm.generate(prompt, params, progress=False)[0].outputs[0]


def metrics(server) -> dict:
    text = httpx.get(server.url + "/metrics").text
    return {s.name: s.value for family in text_string_to_metric_families(text)
            for s in family.samples}


def test_completions_stream_usage_and_oracle(server):
    c = server.client
    prompt = PROMPTS[0]
    full = c.completions.create(model=MODEL, prompt=prompt, max_tokens=12, **GREEDY)
    assert full.object == "text_completion" and full.model == MODEL
    assert full.choices[0].text == offline(server, prompt, 12).text
    assert full.choices[0].finish_reason == "length"
    n_prompt = len(server.tokenizer.encode(prompt))
    assert (full.usage.prompt_tokens, full.usage.completion_tokens, full.usage.total_tokens) == (
        n_prompt, 12, n_prompt + 12)
    chunks = list(c.completions.create(model=MODEL, prompt=prompt, max_tokens=12, stream=True,
                                       stream_options={"include_usage": True}, **GREEDY))
    assert "".join(ch.choices[0].text for ch in chunks[:-1]) == full.choices[0].text
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage == full.usage
    # Token ids, echo and a stop string; then a list of prompts with n = 2, seeded: choice
    # i * n + k is prompt i's k-th completion, the same as asking for prompt i alone.
    ids = server.tokenizer.encode(prompt)
    echoed = c.completions.create(model=MODEL, prompt=ids, max_tokens=12, echo=True, **GREEDY)
    assert echoed.choices[0].text == prompt + full.choices[0].text
    stop = full.choices[0].text[3:6]
    cut = c.completions.create(model=MODEL, prompt=prompt, max_tokens=12, stop=[stop], **GREEDY)
    assert cut.choices[0].text == full.choices[0].text[:full.choices[0].text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"
    batch = c.completions.create(model=MODEL, prompt=PROMPTS[:2], n=2, seed=7, max_tokens=6)
    assert [ch.index for ch in batch.choices] == [0, 1, 2, 3]
    alone = c.completions.create(model=MODEL, prompt=PROMPTS[1], n=2, seed=7, max_tokens=6)
    assert [ch.text for ch in batch.choices[2:]] == [ch.text for ch in alone.choices]


def test_chat_stream_logprobs_and_models(server):
    c = server.client
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
    ids = server.tokenizer.encode(server.tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False), add_special_tokens=False)
    full = c.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=10,
                                     logprobs=True, top_logprobs=3, **GREEDY)
    ref = offline(server, {"prompt_token_ids": ids}, 10, logprobs=3)
    assert full.choices[0].message.role == "assistant"
    assert full.choices[0].message.content == ref.text
    assert full.usage.prompt_tokens == len(ids) and full.usage.completion_tokens == 10
    top3 = [sorted((lp for lp in lps.values() if lp.rank <= 3), key=lambda lp: lp.rank)
            for lps in ref.logprobs]
    content = full.choices[0].logprobs.content
    assert [e.logprob for e in content] == pytest.approx(
        [lps[t].logprob for t, lps in zip(ref.token_ids, ref.logprobs)], abs=1e-5)
    assert [[t.token for t in e.top_logprobs] for e in content] == [
        [lp.decoded_token for lp in top] for top in top3]
    chunks = list(c.chat.completions.create(model=MODEL, messages=messages, max_tokens=10,
                                            stream=True, **GREEDY))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == ref.text
    # Completions-style logprobs of the same tokens: sampled token, top 2, offsets in the text.
    out = c.completions.create(model=MODEL, prompt=ids, max_tokens=10, logprobs=2, **GREEDY)
    out = out.choices[0].logprobs
    assert out.token_logprobs == pytest.approx([e.logprob for e in content], abs=1e-5)
    assert out.tokens == [e.token for e in content]
    assert out.top_logprobs == [{lp.decoded_token: pytest.approx(lp.logprob, abs=1e-5)
                                 for lp in top[:2]} for top in top3]
    assert out.text_offset == [sum(map(len, out.tokens[:j])) for j in range(10)]
    assert [m.id for m in c.models.list()] == [MODEL]
    assert httpx.get(server.url + "/health").status_code == 200


def raw(server, body, path="/v1/completions", key=KEY, **kwargs):
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    if not isinstance(body, bytes):
        body = json.dumps(body).encode()
    return httpx.post(server.url + path, content=body, headers=headers, **kwargs)


OK = {"model": MODEL, "prompt": "hello", "max_tokens": 4}
ERRORS = [  # (body, path, status, param)
    (b"{not json", "/v1/completions", 400, None),
    (b'{"model": "tiny", "prompt": "a", "top_p": NaN}', "/v1/completions", 400, None),  # not JSON
    (b'\xff', "/v1/completions", 400, None),
    ([1, 2], "/v1/completions", 400, None),
    ({"model": MODEL}, "/v1/completions", 400, "prompt"),
    ({"prompt": "hello"}, "/v1/completions", 400, "model"),
    ({**OK, "max_tokens": "4"}, "/v1/completions", 400, "max_tokens"),
    ({**OK, "prompt": [[1], "a"]}, "/v1/completions", 400, "prompt"),
    ({**OK, "prompt": ""}, "/v1/completions", 400, "prompt"),
    ({**OK, "suffix": "x"}, "/v1/completions", 400, "suffix"),
    ({**OK, "temperature": -0.5}, "/v1/completions", 400, "temperature"),
    ({**OK, "top_p": 0}, "/v1/completions", 400, "top_p"),
    ({**OK, "top_p": 1.5}, "/v1/completions", 400, "top_p"),
    ({**OK, "max_tokens": 0}, "/v1/completions", 400, "max_tokens"),
    ({**OK, "n": 0}, "/v1/completions", 400, "n"),
    ({**OK, "presence_penalty": 3}, "/v1/completions", 400, "presence_penalty"),
    ({**OK, "stop": [1]}, "/v1/completions", 400, "stop"),
    ({**OK, "logprobs": 21}, "/v1/completions", 400, "logprobs"),      # over max_logprobs
    ({**OK, "prompt": [5, 100000]}, "/v1/completions", 400, None),      # outside the vocab
    ({**OK, "stream_options": True}, "/v1/completions", 400, "stream_options"),
    ({"model": MODEL, "messages": [{"content": "hi"}]}, "/v1/chat/completions", 400, "messages"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2},
     "/v1/chat/completions", 400, "top_logprobs"),
    ({**OK, "model": "gpt-4"}, "/v1/completions", 404, "model"),
]


def test_error_table(server):
    before = server.engine.get_stats()["prompt_tokens_total"]
    for body, path, status, param in ERRORS:
        response = raw(server, body, path)
        error = response.json()["error"]
        assert (response.status_code, error["param"]) == (status, param), (body, error)
        assert set(error) == {"message", "type", "param", "code"} and error["message"]
    long = raw(server, {**OK, "prompt": [5] * 250, "max_tokens": 10})   # 250 + 10 > 256
    assert long.status_code == 400 and all(n in long.text for n in ("250", "260", "256"))
    for key in (None, "wrong"):
        assert raw(server, OK, key=key).status_code == 401
        headers = {"Authorization": f"Bearer {key}"}
        assert httpx.get(server.url + "/v1/models", headers=headers).status_code == 401
    huge = raw(server, b" " * (MAX_BODY_BYTES + 1))
    assert huge.status_code == 413 and huge.json()["error"]["message"]
    assert httpx.get(server.url + "/v1/completions").status_code == 405
    with pytest.raises(openai.NotFoundError):
        server.client.completions.create(model="nope", prompt="hi")
    with pytest.raises(openai.BadRequestError, match="temperature"):
        server.client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], temperature=-1)
    assert server.engine.get_stats()["prompt_tokens_total"] == before   # none reached the engine


def test_engine_step_failure_is_a_500_and_the_server_goes_on(server, monkeypatch):
    # The engine core in a thread of this process (--no-engine-process), so that its executor
    # can be made to fail; the failure travels the same way as from the engine core process.
    engine = AsyncLLM(server.path, **CONFIG, engine_process=False)
    executor, calls = engine.engine_core.core.executor, []
    real = executor.execute_model

    def fail_once(*args):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("boom")
        return real(*args)
    monkeypatch.setattr(executor, "execute_model", fail_once)
    with serve(engine, MODEL, KEY) as url:
        inproc = SimpleNamespace(url=url, client=openai.OpenAI(base_url=url + "/v1", api_key=KEY,
                                                               max_retries=0))
        response = raw(inproc, OK)
        assert response.status_code == 500 and "boom" in response.json()["error"]["message"]
        calls.clear()
        with pytest.raises(openai.APIError, match="boom"):
            list(inproc.client.completions.create(model=MODEL, prompt="hi", max_tokens=4,
                                                  stream=True))
        assert raw(inproc, OK).status_code == 200
        assert httpx.get(url + "/health").status_code == 200


@pytest.mark.parametrize("error", [
    "AcceleratorError: CUDA error: an illegal memory access was encountered",   # torch >= 2.8
    "RuntimeError: CUDA error: device-side assert triggered"])                  # older torch
def test_a_cuda_error_in_a_step_kills_the_engine(server, monkeypatch, error):
    """Unlike a failed step (above), a CUDA error leaves the device unusable: every later step
    would fail too, so the engine is dead, and /health says so."""
    import torch
    kind, message = error.split(": ", 1)
    engine = AsyncLLM(server.path, **CONFIG, engine_process=False)

    def fail(*args):
        raise getattr(torch, kind, RuntimeError)(message)
    monkeypatch.setattr(engine.engine_core.core.executor, "execute_model", fail)
    with serve(engine, MODEL, KEY) as url:
        response = raw(SimpleNamespace(url=url), OK)    # in flight when the engine died: 500
        assert response.status_code == 500 and message in response.json()["error"]["message"]
        health = httpx.get(url + "/health")
        assert health.status_code == 503 and message in health.json()["error"]["message"]
        assert raw(SimpleNamespace(url=url), OK).status_code == 503


@pytest.mark.parametrize("stream", [True, False])
def test_disconnect_aborts_and_frees_blocks(server, stream):
    before = metrics(server)["nanoserve:generation_tokens_total"]
    body = {**OK, "max_tokens": 240, "stream": stream, "ignore_eos": True}
    headers = {"Authorization": f"Bearer {KEY}"}
    if stream:           # read one event, then hang up
        with httpx.stream("POST", server.url + "/v1/completions", json=body, headers=headers) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ") and next(lines) == ""
    else:                # give up waiting for the whole answer, 20 ms after the request is sent
        # (a read timeout, which starts once the request is written: a fixed 0.1 s left ~100-185
        # of nanoserve-tiny's tokens generated first, too close to the bound below)
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(server.url + "/v1/completions", json=body, headers=headers,
                       timeout=httpx.Timeout(5.0, read=0.02))
    deadline = time.monotonic() + 10
    while (m := metrics(server))["nanoserve:kv_cache_usage_perc"] > 0:
        assert time.monotonic() < deadline, m
        time.sleep(0.01)
    assert m["nanoserve:num_requests_running"] == 0
    # Aborted, not run to the end: far fewer than 240 tokens were generated.
    assert m["nanoserve:generation_tokens_total"] - before < 150
    assert m["nanoserve:time_to_first_token_seconds_count"] > 0
    for name in ("num_requests_waiting", "num_preemptions_total", "prefix_cache_queries_total",
                 "prefix_cache_hits_total", "prompt_tokens_total",
                 "inter_token_latency_seconds_count", "e2e_request_latency_seconds_count"):
        assert "nanoserve:" + name in m


def test_concurrent_streams_and_a_slow_reader(server):
    prompts = [f"{PROMPTS[i % 4]} {i}" for i in range(32)]
    expected = [offline(server, p, 8).text for p in prompts]
    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
    others_done = asyncio.Event()

    async def stream(i):
        chunks = await client.completions.create(model=MODEL, prompt=prompts[i], max_tokens=8,
                                                 stream=True, **GREEDY)
        text = ""
        async for chunk in chunks:
            if i == 0:       # the slow reader: holds its stream until all the others are done
                await others_done.wait()
            text += chunk.choices[0].text
        return text

    async def main():
        slow = asyncio.create_task(stream(0))
        texts = await asyncio.wait_for(asyncio.gather(*(stream(i) for i in range(1, 32))), 60)
        assert not slow.done()
        others_done.set()
        return [await slow] + texts
    assert asyncio.run(main()) == expected


def test_serve_cli_flags():
    from nanoserve.cli import build_parser
    from nanoserve.config import Config
    args = build_parser().parse_args(["serve", "--api-key", "k", "--max-model-len", "64"])
    assert (args.host, args.port, args.api_key) == ("127.0.0.1", 8000, "k")
    assert Config.from_cli_args(args) == Config(model="nanoserve-tiny", max_model_len=64)
    assert build_parser().parse_args(["serve", "path/to/ckpt"]).model == "path/to/ckpt"
    assert Config().engine_process and not Config.from_cli_args(
        build_parser().parse_args(["serve", "--no-engine-process"])).engine_process


def test_dead_engine_core_process_fails_open_streams_and_health(server):
    """SIGKILL the engine core process mid-stream: the open stream ends with an error, /health
    turns 503 and a new request is refused, within seconds, instead of everyone waiting."""
    engine = AsyncLLM(server.path, **CONFIG)
    ((_, pid),) = [p for p in engine.engine_core.processes if p[0] == "engine core 0"]
    with serve(engine, MODEL, KEY) as url:
        assert httpx.get(url + "/health").status_code == 200
        body = {**OK, "max_tokens": 240, "stream": True, "ignore_eos": True}
        headers = {"Authorization": f"Bearer {KEY}"}
        with httpx.stream("POST", url + "/v1/completions", json=body, headers=headers,
                          timeout=10) as r:
            lines = (line for line in r.iter_lines() if line)
            assert "error" not in next(lines)
            os.kill(pid, signal.SIGKILL)
            rest = list(lines)      # the stream ends: no more tokens can come
        errors = [json.loads(line[len("data: "):])["error"] for line in rest if '"error"' in line]
        assert errors and "engine core" in errors[0]["message"] and rest[-1] == "data: [DONE]"
        health = httpx.get(url + "/health")
        assert health.status_code == 503 and str(pid) in health.json()["error"]["message"]
        assert raw(SimpleNamespace(url=url), OK).status_code == 503


def test_an_error_in_the_engine_core_loop_fails_every_stream(server, monkeypatch):
    """Not a failed step (that fails its own requests only) but the loop itself: every open
    stream, and every request after it, gets EngineDeadError saying why."""
    engine = AsyncLLM(server.path, **CONFIG, engine_process=False)
    scheduler, calls = engine.engine_core.core.scheduler, []
    real = scheduler.schedule

    def schedule():
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("scheduler bug")
        return real()
    monkeypatch.setattr(scheduler, "schedule", schedule)

    async def run(i):
        async for _ in engine.generate("hello", SamplingParams(max_tokens=50, ignore_eos=True),
                                       f"r{i}"):
            pass

    async def main():
        results = await asyncio.wait_for(asyncio.gather(run(0), run(1), return_exceptions=True), 30)
        with pytest.raises(EngineDeadError, match="scheduler bug"):
            await run(2)
        await engine.shutdown()
        return results
    results = asyncio.run(main())
    assert all(isinstance(r, EngineDeadError) and "scheduler bug" in str(r) for r in results), results


def _descendants(pid: int) -> set[int]:
    children = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        children |= {int(c) for c in (task / "children").read_text().split()}
    return children.union(*(_descendants(c) for c in children)) if children else children


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"   # not a zombie
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads the process tree in /proc")
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_serve_logs_its_processes_and_none_outlives_it(server, sig):
    """`nanoserve serve` names each process it started; after SIGTERM (a clean shutdown) or
    SIGKILL of the API server (no shutdown at all) none of them is left."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    proc = subprocess.Popen([sys.executable, "-m", "nanoserve.cli", "serve", server.path,
                             "--port", str(port), "--device", "cpu", "--num-kv-blocks", "16",
                             "--max-model-len", "256"],
                            stderr=subprocess.PIPE, text=True)
    try:
        roles, sizing = {}, []
        for line in proc.stderr:
            if m := re.match(r"nanoserve serve: (.+): pid (\d+)", line):
                roles[m.group(1)] = int(m.group(2))
            sizing += [line.strip()] if "KV cache size" in line else []
            if "Uvicorn running" in line or "Application startup complete" in line:
                break
        assert roles.keys() == {"api server", "engine core 0"} and roles["api server"] == proc.pid
        assert sizing == [("nanoserve serve: KV cache size: 256 tokens (16 blocks of 16); maximum "
                           "concurrency for 256 tokens per request: 1.00x")]     # lesson 10
        assert httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200
        tree = _descendants(proc.pid)
        assert roles["engine core 0"] in tree
        proc.send_signal(sig)
        assert proc.wait(30) in (0, -sig)   # uvicorn re-raises SIGTERM once it has shut down
        deadline = time.monotonic() + 10
        while any(_alive(p) for p in tree):
            assert time.monotonic() < deadline, [p for p in tree if _alive(p)]
            time.sleep(0.05)
    finally:
        proc.kill()
        proc.wait()


def test_admission_control_timeouts_and_bounds():
    """max_waiting_requests: the next request gets 503 + Retry-After (counted in /metrics);
    request_timeout_s: a request still unfinished is aborted and its client told (408); n and the
    number of prompts are bounded with 400s. The engine never sees the held requests here (their
    "add" is dropped), so they wait for as long as the test needs."""
    engine = AsyncLLM(engine_process=False, max_waiting_requests=2, request_timeout_s=1.0,
                      max_model_len=256)
    send = engine.engine_core.send
    engine.engine_core.send = lambda kind, payload: None if kind == "add" else send(kind, payload)
    body = {"model": "nanoserve-tiny", "prompt": "Once", "max_tokens": 4}
    with serve(engine, "nanoserve-tiny") as url:
        async def scenario():
            async with httpx.AsyncClient(base_url=url, timeout=30) as client:
                held = [asyncio.create_task(client.post("/v1/completions", json=body))
                        for _ in range(2)]
                await asyncio.sleep(0.3)
                refused = await client.post("/v1/completions", json=body)
                timed_out = await asyncio.gather(*held)
                return refused, timed_out, await client.get("/metrics")
        refused, timed_out, metrics = asyncio.run(scenario())
        assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
        assert "max_waiting_requests" in refused.json()["error"]["message"]
        assert [r.status_code for r in timed_out] == [408, 408]
        assert "request_timeout_s" in timed_out[0].json()["error"]["message"]
        assert "nanoserve:requests_rejected_total 1.0" in metrics.text
        assert "nanoserve:requests_timed_out_total 2.0" in metrics.text
        too_many = httpx.post(f"{url}/v1/completions", json={**body, "n": 129})
        assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "n"
        batch = httpx.post(f"{url}/v1/completions", json={**body, "prompt": ["a", "b", "c"]})
        assert batch.status_code == 400 and batch.json()["error"]["param"] == "prompt"
