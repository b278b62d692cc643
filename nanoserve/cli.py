"""cli.py: the `nanoserve` command. Each subcommand parses flags and calls one layer.

    nanoserve generate "Once upon a time"                 # the built-in model, streamed
    nanoserve generate --chat "Tell me a story about a cat"
    nanoserve generate "Hello" --model path/to/checkpoint --max-tokens 64 --temperature 0.8

Every Config field is a flag (`--max-model-len`, `--block-size`, `--trace run.jsonl`, ...),
generated from config.py, so a new field needs no code here.
"""

from __future__ import annotations

import argparse
import sys

from nanoserve.config import Config


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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nanoserve", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

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
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except ValueError as e:     # bad flags or input: a clear message, not a traceback
        sys.exit(f"nanoserve: error: {e}")


if __name__ == "__main__":
    main()
