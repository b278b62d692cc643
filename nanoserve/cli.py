"""cli.py: the `nanoserve` command. Each subcommand parses flags and calls one layer.

    nanoserve generate "Once upon a time"                 # the built-in model, streamed
    nanoserve generate --chat "Tell me a story about a cat"
    nanoserve generate "Hello" --model path/to/checkpoint --max-tokens 64 --temperature 0.8
    nanoserve serve                                       # OpenAI-compatible API on 127.0.0.1:8000
    nanoserve serve path/to/checkpoint --port 8080 --api-key secret --max-model-len 2048
    nanoserve serve --data-parallel-size 2                # two engine cores, one API server
    nanoserve serve --headless --data-parallel-size 2 --data-parallel-rank 1 \
        --data-parallel-address HOST                      # rank 1 here, the API server on HOST
    nanoserve trace run.jsonl --step 12                   # replay a --trace file (replay.py)
    nanoserve memory path/to/checkpoint --device-memory-gb 80   # do weights + KV cache fit?
    nanoserve cost --prices examples/prices.json --requests-per-day 1e5 ...  # self-host or API?
    nanoserve bench --dtype bfloat16                      # offline throughput vs the matmul peak
    nanoserve bench --serve --request-rate 2 --plot cdf.png   # load a running server (any)
    nanoserve exercise check 3.3                          # a lesson's build exercise (lessons/)

Every Config field is a flag (`--max-model-len`, `--block-size`, `--trace run.jsonl`, ...),
generated from config.py, so a new field needs no code here.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import sys

from nanoserve.config import DEFAULT_MODEL, Config


def _generate(args: argparse.Namespace) -> None:
    from nanoserve.engine import LLM
    from nanoserve.sampling_params import SamplingParams
    llm = LLM(**vars(Config.from_cli_args(args)))
    prompt = args.prompt
    if args.chat:
        prompt = llm.tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                                   tokenize=False, add_generation_prompt=True)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            top_p=args.top_p, top_k=args.top_k, seed=args.seed)
    if not args.chat:
        print(prompt, end="", flush=True)
    for delta in llm.stream(prompt, params):
        print(delta, end="", flush=True)
    print()


def _serve(args: argparse.Namespace) -> None:
    import asyncio
    import functools

    import uvicorn

    from nanoserve.api import build_app
    from nanoserve.engine import AsyncLLM
    from nanoserve.http_limits import LOOPBACK_HOSTS, H11Protocol, is_loopback
    config = Config.from_cli_args(args)
    if config.headless:              # engine cores only, for an API server on another host
        from nanoserve.core_client import run_headless
        return run_headless(config)
    engine = AsyncLLM(**vars(config))
    for role, pid in engine.engine_core.processes:      # the process tree, for ps / kill / top
        print(f"nanoserve serve: {role}: pid {pid}", file=sys.stderr, flush=True)
    s = engine.config      # resolved; the two numbers vLLM logs at start-up (lessons/10-clinic.md)
    print(f"nanoserve serve: KV cache size: {s.num_kv_blocks * s.block_size:,} tokens "
          f"({s.num_kv_blocks} blocks of {s.block_size}); maximum concurrency for "
          f"{s.max_model_len:,} tokens per request: "
          f"{s.num_kv_blocks / -(-s.max_model_len // s.block_size):.2f}x", file=sys.stderr)
    allowed_hosts = args.allowed_hosts or (LOOPBACK_HOSTS if is_loopback(args.host) else ["*"])
    app = build_app(engine, args.served_model_name or config.model, args.api_key, allowed_hosts,
                    args.allowed_origins)
    server = uvicorn.Server(uvicorn.Config(
        app, host=args.host, port=args.port, access_log=False,   # api.py logs requests
        http=functools.partial(H11Protocol, timeout_request_head=args.timeout_request_head),
        limit_concurrency=args.limit_concurrency, timeout_keep_alive=args.timeout_keep_alive))
    with contextlib.suppress(KeyboardInterrupt):    # Ctrl-C: shut down quietly, as uvicorn.run
        asyncio.run(_serve_until_engine_death(server, engine, args.keep_alive_on_engine_death))
    if engine.dead_error is not None:
        sys.exit(f"nanoserve serve: exiting, the engine is dead: {engine.dead_error}")


async def _serve_until_engine_death(server, engine, keep_alive: bool) -> None:
    """Serve until stopped or, unless `keep_alive`, until the engine dies: every engine core
    rank, the output handler (vLLM exits too, unless VLLM_KEEP_ALIVE_ON_ENGINE_DEATH). Its open
    streams have their error by then (AsyncLLM fails them first); a supervisor (systemd,
    Kubernetes) restarts a server that exits, while one answering 503 forever helps nobody."""
    def on_engine_done(_) -> None:
        if engine.dead_error is not None and not keep_alive:
            server.should_exit = True     # uvicorn's graceful shutdown: open streams end first
    engine.run_output_handler().add_done_callback(on_engine_done)  # now: an idle death counts
    await server.serve()


def _list_arg(value: str) -> list[str]:
    """A JSON list (vLLM's form: '["https://a.example"]') or comma-separated names."""
    names = json.loads(value) if value.lstrip().startswith("[") else value.split(",")
    if not isinstance(names, list) or not all(isinstance(n, str) and n for n in names):
        raise ValueError(f"expected a list of names (got {value!r})")
    return names


def _trace(args: argparse.Namespace) -> None:
    from nanoserve.tools import replay, replay_plots     # the frames; the numbers and figures
    others = dict(with_summary=args.summary, plot=args.plot, chrome=args.chrome,
                  compare=args.compare)
    trace = replay.main(args.file, step=args.step, speed=args.speed,
                        animate=not any(others.values()))
    replay_plots.main(trace, **others, lang=args.lang)


def _memory(args: argparse.Namespace) -> None:
    from nanoserve.tools.memory import main as memory
    memory(**{k: v for k, v in vars(args).items() if k not in ("command", "func")})


def _cost(args: argparse.Namespace) -> None:
    from nanoserve.tools.cost import main as cost
    cost(**{k: v for k, v in vars(args).items() if k not in ("command", "func")})


def _bench(args: argparse.Namespace) -> None:
    if args.serve:
        import inspect

        from nanoserve.tools import bench_serve
        wanted = inspect.signature(bench_serve.main).parameters
        bench_serve.main(**{k: v for k, v in vars(args).items() if k in wanted})
        return
    from nanoserve.tools import bench
    config = {k: v for k, v in vars(args).items()
              if k in {f.name for f in dataclasses.fields(Config)} and k not in ("model", "dtype")}
    bench.main(args.model, args.num_prompts, args.input_len, args.output_len, args.dtype, **config)


def _exercise(args: argparse.Namespace) -> None:
    # The lessons are not part of the package: look in the working directory (a checkout),
    # then beside the package (an editable install).
    import importlib.util
    from pathlib import Path
    paths = [root / "lessons" / "checks.py" for root in (Path.cwd(), Path(__file__).parents[1])]
    path = next((p for p in paths if p.is_file()), None)
    if path is None:
        raise ValueError("lessons/checks.py not found: run `nanoserve exercise` in the nanoserve "
                         "repository")
    spec = importlib.util.spec_from_file_location("lessons_checks", path)
    checks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(checks)
    sys.exit(checks.main(args.action, args.id, args.solution))


def _add_generate(sub) -> None:
    gen = sub.add_parser("generate", help="Generate text for one prompt, streamed to the terminal.")
    gen.add_argument("prompt", help="The prompt (with --chat: the user's message).")
    gen.add_argument("--chat", action="store_true", help="Wrap the prompt in the chat template.")
    gen.add_argument("--max-tokens", type=int, default=128, help="Tokens to generate at most.")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy.")
    gen.add_argument("--top-p", type=float, default=1.0, help="Nucleus sampling mass.")
    gen.add_argument("--top-k", type=int, default=0, help="Keep the k most likely tokens (0 = all).")
    gen.add_argument("--seed", type=int, default=0, help="The request's seed (same seed, same text).")
    Config.add_cli_args(gen, skip=("seed",))
    gen.set_defaults(func=_generate)


def _add_serve(sub) -> None:
    srv = sub.add_parser("serve", help="Serve the OpenAI-compatible HTTP API "
                         "(/v1/completions, /v1/chat/completions, /v1/models, /health, /metrics; "
                         "structured outputs: response_format, structured_outputs).")
    srv.add_argument("model", nargs="?", default=DEFAULT_MODEL,
                     help=Config.__dataclass_fields__["model"].metadata["help"])
    srv.add_argument("--host", default="127.0.0.1", help="Address to bind (loopback by default).")
    srv.add_argument("--port", type=int, default=8000, help="Port to listen on.")
    srv.add_argument("--api-key", default=os.environ.get("NANOSERVE_API_KEY") or None,
                     help="Require 'Authorization: Bearer KEY' on /v1/* (default: the "
                     "NANOSERVE_API_KEY environment variable, which `ps` does not show).")
    srv.add_argument("--served-model-name", default=None,
                     help="The model name clients send (default: MODEL as given).")
    srv.add_argument("--keep-alive-on-engine-death", action="store_true",
                     help="Keep serving (/health 503) when the engine dies; by default the "
                     "server exits with status 1 then, for its supervisor to restart it.")
    _add_http_limits(srv)
    Config.add_cli_args(srv, skip=("model",))
    srv.set_defaults(func=_serve)


def _add_http_limits(srv) -> None:
    http = srv.add_argument_group("HTTP limits (uvicorn's, and who may call)")
    http.add_argument("--allowed-origins", type=_list_arg, default=[], help="Web origins whose "
                      "pages may call the API from a browser (CORS), as a JSON list or comma-"
                      "separated; '*' for any. Default: none.")
    http.add_argument("--allowed-hosts", type=_list_arg, default=None, help="Host header names "
                      "answered (others get 400); '*' for any. Default: loopback names when "
                      "--host is loopback (no DNS rebinding), else any.")
    http.add_argument("--limit-concurrency", type=int, default=1024, help="Open connections "
                      "(or requests in progress) beyond which new requests get HTTP 503.")
    http.add_argument("--timeout-keep-alive", type=int, default=5, help="Seconds an idle "
                      "connection stays open after a response.")
    http.add_argument("--timeout-request-head", type=float, default=10.0, help="Seconds a "
                      "connection may take to send a request's line and headers (from opening, or "
                      "from its previous response) before it is closed.")


def _add_trace(sub) -> None:
    trc = sub.add_parser("trace", help="Replay a --trace file: animated in the terminal (no "
                         "option), one frame, a summary, figures or a Chrome trace.")
    trc.add_argument("file", help="A JSONL trace written with --trace.")
    trc.add_argument("--step", type=int, metavar="N", help="Print the frame after step N and exit.")
    trc.add_argument("--speed", type=float, default=4.0, help="Steps per second of the animation "
                     "(keys on a terminal: space pause, n/b step, q quit).")
    trc.add_argument("--plot", metavar="DIR", help="Write PNGs to DIR: request Gantt, KV blocks, "
                     "tokens per step, latency CDFs.")
    trc.add_argument("--lang", choices=["en", "ja"], default="en", help="The figures' language "
                     "(ja: pip install 'nanoserve[ja]'); the terminal's replay stays English.")
    trc.add_argument("--summary", action="store_true", help="Print requests, steps, preemptions, "
                     "prefix hit rate, batch size, structured outputs and latency percentiles.")
    trc.add_argument("--chrome", metavar="FILE", help="Write Chrome/Perfetto trace-event JSON.")
    trc.add_argument("--compare", metavar="FILE", help="Another trace (e.g. the same workload "
                     "on the reference engine): both summaries side by side.")
    trc.set_defaults(func=_trace)


def _add_memory(sub) -> None:
    mem = sub.add_parser("memory", help="Do the weights and the KV cache fit? Sizes the KV pool "
                         "with the engine's own code: blocks, tokens, sequences, a verdict.")
    mem.add_argument("model", nargs="?", default=DEFAULT_MODEL, help="A checkpoint directory, its "
                     "config.json or a Hugging Face id (config.json only is fetched); default: built-in.")
    mem.add_argument("--device-memory-gb", type=float, help="GPU memory in GiB (default: the "
                     "detected GPU; with none, the engine's CPU rule).")
    mem.add_argument("--kv-cache-dtype", default="auto", help="auto (the model dtype), float32, "
                     "bfloat16, float16 or fp8 (vLLM's option; nanoserve stores the model dtype).")
    mem.add_argument("--tensor-parallel-size", type=int, default=1,
                     help="GPUs the model is split over; the figures are per GPU.")
    mem.add_argument("--data-parallel-size", type=int, default=1, help="Engine cores serving "
                     "copies of the model (each on its own TP GPUs); the figures are per rank, "
                     "the last row all of them.")
    mem.add_argument("--enable-expert-parallel", action="store_true", help="A mixture of "
                     "experts: each GPU holds E/N whole experts, not a slice of each.")
    mem.add_argument("--activation-reserve-gb", type=float, help="The activation peak in GiB, "
                     "e.g. as the engine measured it (default: estimated from the config).")
    mem.add_argument("--plot", metavar="FILE", help="Write a figure: memory against context "
                     "length and batch size.")
    mem.add_argument("--lang", choices=["en", "ja"], default="en", help="The figure's language "
                     "(ja: pip install 'nanoserve[ja]'); the table stays English.")
    sizing = ("dtype", "max_model_len", "block_size", "kv_cache_memory_gb",
              "gpu_memory_utilization", "max_num_seqs", "max_num_batched_tokens", "quantization")
    Config.add_cli_args(mem, skip=tuple(f.name for f in dataclasses.fields(Config)
                                        if f.name not in sizing))
    mem.set_defaults(func=_memory)


def _add_cost(sub) -> None:
    cst = sub.add_parser("cost", help="Self-host or pay per token? Monthly cost of both, the "
                         "break-even volume and the GPU utilisation there.")
    cst.add_argument("--prices", metavar="FILE", help="JSON with dated prices and their sources "
                     "(e.g. examples/prices.json); a flag wins over the file.")
    cst.add_argument("--requests-per-day", type=float, help="Requests per day.")
    cst.add_argument("--prompt-tokens", type=int, help="Prompt tokens per request.")
    cst.add_argument("--output-tokens", type=int, help="Output tokens per request.")
    cst.add_argument("--api-input-price", type=float, help="API $ per million prompt tokens.")
    cst.add_argument("--api-output-price", type=float, help="API $ per million output tokens.")
    cst.add_argument("--gpu-price-per-hour", type=float, help="$ per GPU-hour.")
    cst.add_argument("--throughput", type=float, help="Output tokens/s one server sustains on "
                     "this workload (measure it with `nanoserve bench` at the same lengths).")
    cst.add_argument("--gpus-per-server", type=int, help="GPUs one server needs (e.g. its "
                     "tensor parallel size; default 1).")
    cst.add_argument("--plot", metavar="FILE", help="Write a figure of both monthly costs "
                     "against requests per day.")
    cst.set_defaults(func=_cost)


def _add_bench(sub) -> None:
    bch = sub.add_parser("bench", help="Offline throughput on the standard workload (random "
                         "SmolLM2-135M-shaped weights unless --model), against the matmul peak; "
                         "with --serve, latency and throughput of a running server under load.")
    bch.add_argument("--num-prompts", type=int, default=64, help="Requests in the workload.")
    bch.add_argument("--input-len", type=int, nargs=2, default=(32, 512), metavar=("MIN", "MAX"),
                     help="Prompt lengths, uniform in [MIN, MAX].")
    bch.add_argument("--output-len", type=int, nargs=2, default=(32, 256), metavar=("MIN", "MAX"),
                     help="Output lengths, uniform in [MIN, MAX].")
    Config.add_cli_args(bch)
    bch.set_defaults(func=_bench, model=None, kv_cache_memory_gb=4.0, max_model_len=1024)
    # --serve: load a running server over HTTP (bench_serve.py); flags named as `vllm bench serve`'s
    srv_bch = bch.add_argument_group("serving benchmark (--serve; --model: the model name to "
                                     "request, default: the first of /v1/models)")
    srv_bch.add_argument("--serve", action="store_true", help="Benchmark a running "
                         "OpenAI-compatible server with streamed /v1/completions instead.")
    srv_bch.add_argument("--base-url", default="http://127.0.0.1:8000", help="The server's URL.")
    srv_bch.add_argument("--request-rate", type=float, default=float("inf"), help="Poisson "
                         "arrivals per second (inf: every request at once).")
    srv_bch.add_argument("--random-input-len", type=int, help="Prompt length L (instead of "
                         "--input-len): uniform in [L(1-r), L(1+r)], r = --random-range-ratio.")
    srv_bch.add_argument("--random-output-len", type=int, help="The same for max_tokens.")
    srv_bch.add_argument("--random-range-ratio", type=float, default=0.0, help="r in [0, 1).")
    srv_bch.add_argument("--temperature", type=float, default=0.0, help="0 = greedy.")
    srv_bch.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                         help="Generate exactly max_tokens per request.")
    srv_bch.add_argument("--slo-ttft-ms", type=float, help="Goodput SLO on time to first token.")
    srv_bch.add_argument("--slo-itl-ms", type=float, help="Goodput SLO on a request's mean "
                         "inter-token latency (TPOT).")
    srv_bch.add_argument("--num-warmups", type=int, default=1, help="Short requests sent first, "
                         "off the clock.")
    srv_bch.add_argument("--plot", metavar="FILE", help="Write the latency CDFs and output "
                         "tokens/s over time.")
    srv_bch.add_argument("--save-result", metavar="FILE", help="Write the metrics as JSON.")


def _add_exercise(sub) -> None:
    exe = sub.add_parser("exercise", help="Check a lesson's build exercise: your file in "
                         "lessons/exercises/ against the exercise's oracle.")
    exe.add_argument("action", choices=("list", "check"), help="list the exercises, or check one.")
    exe.add_argument("id", nargs="?", help="The exercise to check, e.g. 3.3.")
    exe.add_argument("--solution", action="store_true",
                     help="Check the reference solution in lessons/solutions/ instead.")
    exe.set_defaults(func=_exercise)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nanoserve", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for add in (_add_generate, _add_serve, _add_trace, _add_memory, _add_cost, _add_bench,
                _add_exercise):
        add(sub)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except ValueError as e:     # bad flags or input: a clear message, not a traceback
        sys.exit(f"nanoserve: error: {e}")


if __name__ == "__main__":
    main()
