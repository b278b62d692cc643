"""bench_structured.py: what structured outputs cost: the same 64-request workload with 0, 8 and
64 requests under a JSON schema, side by side, and the time to compile a mid-sized schema.

    python scripts/bench_structured.py                       # the built-in model, its tokenizer
    python scripts/bench_structured.py --model path/to/checkpoint --rounds 5
    python scripts/bench_structured.py --num-prompts 8 --output-len 8 16 --rounds 1   # a smoke run

The workload is nanoserve bench's (random prompt token ids, output lengths uniform, seed 0,
greedy, ignore_eos), sized for the built-in model's 512 positions. A structured request's
schema is an array of at least 100 records of SCHEMA's 20 fields: it cannot end within its
output length, so every request writes exactly the tokens a plain one does and the three
runs do the same work but for the grammar. The runs take turns, `--rounds` times, and each
figure is the median, so a machine whose speed drifts slows all three alike. The engine's
`grammar` time (building each step's bitmask, advancing the matchers) and `sample` time (where
the mask is applied) are printed per step. `--model` needs a tokenizer that can spell JSON
(the word-level one of `nanoserve bench`'s random checkpoint cannot).
"""

import argparse
import json
import statistics
import time

from nanoserve.sampling_params import SamplingParams, StructuredOutputsParams
from nanoserve.structured_output import compile_grammar, grammar_compiler
from nanoserve.tools.bench import cpu_description, make_bench_llm, make_workload

NAME = {"type": "string", "pattern": "^[A-Za-z ]{1,16}$"}
# A mid-sized schema: 20 fields of every common kind (strings, patterns, enums, bounded numbers,
# booleans, a nested object, arrays).
SCHEMA = {"type": "object", "properties": {
    "id": {"type": "integer", "minimum": 0}, "name": NAME, "surname": NAME,
    "email": {"type": "string", "format": "email"}, "age": {"type": "integer", "minimum": 0,
                                                             "maximum": 150},
    "height_m": {"type": "number"}, "active": {"type": "boolean"},
    "role": {"enum": ["admin", "user", "guest"]}, "city": NAME, "country": NAME,
    "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
    "phone": {"type": "string", "pattern": "^\\+?[0-9]{7,12}$"},
    "tags": {"type": "array", "items": NAME, "maxItems": 4},
    "scores": {"type": "array", "items": {"type": "integer"}, "maxItems": 4},
    "manager": {"type": ["string", "null"]}, "created": {"type": "string", "format": "date"},
    "notes": NAME, "level": {"type": "integer", "minimum": 1, "maximum": 10},
    "address": {"type": "object", "properties": {"street": NAME, "number": {"type": "integer"}},
                "required": ["street", "number"]},
    "verified": {"type": "boolean"}},
    "required": ["id", "name", "surname", "email", "age", "height_m", "active", "role", "city",
                 "country", "zip", "phone", "tags", "scores", "manager", "created", "notes",
                 "level", "address", "verified"]}
WORKLOAD_SCHEMA = {"type": "array", "items": SCHEMA, "minItems": 100}


def run(llm, prompts, output_lens, num_structured: int) -> dict:
    """One timed run with `num_structured` of the requests (spread evenly) under the schema."""
    engine, every = llm.engine, len(prompts) // num_structured if num_structured else 0
    structured = StructuredOutputsParams(json=WORKLOAD_SCHEMA)
    params = [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=n,
                             structured_outputs=structured if every and i % every == 0 else None)
              for i, n in enumerate(output_lens)]
    engine.timings.update(dict.fromkeys(engine.timings, 0.0))
    steps_before = engine.scheduler.num_steps
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, progress=False)
    elapsed = time.perf_counter() - start
    written = [len(o.outputs[0].token_ids) for o in outs]
    assert written == output_lens, "a request ended early: the comparison would be unequal"
    steps = engine.scheduler.num_steps - steps_before
    return {"tok_s": sum(written) / elapsed,
            "ms_per_step": {k: 1e3 * v / steps for k, v in engine.timings.items()}}


def compile_times(llm, repeats: int) -> tuple[float, float]:
    """(median seconds of one compile of SCHEMA, of a cache hit), with the model's tokenizer."""
    import xgrammar
    cached = grammar_compiler(llm.processor.tokenizer_source, llm.engine.vocab_size)
    params = StructuredOutputsParams(json=SCHEMA)
    fresh = xgrammar.GrammarCompiler(compile_grammar(cached, params).tokenizer_info,
                                     cache_enabled=False)
    cold, hot = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        compile_grammar(fresh, params)
        cold.append(time.perf_counter() - start)
        start = time.perf_counter()
        compile_grammar(cached, params)
        hot.append(time.perf_counter() - start)
    return statistics.median(cold), statistics.median(hot)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="checkpoint (default: nanoserve-tiny)")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, nargs=2, default=[32, 256])
    parser.add_argument("--output-len", type=int, nargs=2, default=[32, 200])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = parser.parse_args()
    from nanoserve.config import DEFAULT_MODEL
    llm = make_bench_llm(args.model or DEFAULT_MODEL, args.dtype, max_model_len=512,
                         kv_cache_memory_gb=1)
    prompts, output_lens = make_workload(args.num_prompts, tuple(args.input_len),
                                         tuple(args.output_len), llm.engine.vocab_size)
    counts = sorted({0, min(8, args.num_prompts), args.num_prompts})
    run(llm, prompts[:4], output_lens[:4], 4)          # compile and warm up once, untimed
    results = {n: [] for n in counts}
    for r in range(args.rounds):
        for n in counts if r % 2 == 0 else counts[::-1]:
            results[n].append(run(llm, prompts, output_lens, n))
    print(f"machine: {cpu_description()}")
    print(f"model: {args.model or DEFAULT_MODEL} ({args.dtype}), vocab {llm.engine.vocab_size}, "
          f"{args.num_prompts} requests, {sum(output_lens)} output tokens, median of "
          f"{args.rounds} rounds")
    base = statistics.median(x["tok_s"] for x in results[0])
    for n in counts:
        tok_s = statistics.median(x["tok_s"] for x in results[n])
        split = results[n][-1]["ms_per_step"]
        print(f"{n:3d} structured: {tok_s:8.1f} output tok/s  ({tok_s / base:.3f}x of 0)  ms/step: "
              + ", ".join(f"{k} {v:.2f}" for k, v in split.items()))
    cold, hot = compile_times(llm, repeats=10)
    print(f"compile of a {len(SCHEMA['properties'])}-field schema ({len(json.dumps(SCHEMA))} "
          f"chars): {cold * 1e3:.2f} ms; again, from the cache: {hot * 1e3:.3f} ms")


if __name__ == "__main__":
    main()
