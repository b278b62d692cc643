"""Structured outputs (structured_output.py, the bitmask in sampler.py): on the built-in model and
its own tokenizer, through the official `openai` client against one live server. The oracles:
`jsonschema` for JSON schemas, `re.fullmatch` for regexes and choices, xgrammar's own matcher and
a regex for an EBNF grammar; plain requests' greedy tokens unchanged beside structured ones;
preemption and tensor parallel change no token; xgrammar's own op for the mask.

    python -m pytest -q tests/test_structured_outputs.py
"""

import json
import re
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import jsonschema
import openai
import pytest
import torch

from nanoserve import LLM, AsyncLLM, SamplingParams
from nanoserve.sampler import apply_grammar_bitmask
from nanoserve.sampling_params import StructuredOutputsParams
from nanoserve.trace import Trace
from test_api import serve

MODEL = "nanoserve-tiny"
STORY = [{"role": "user", "content": "Tell me a story about a cat."}]
NAME = "^[A-Z][a-z]{1,10}$"     # strings bounded by a pattern (see SCHEMA)
# Strings bounded by `pattern`, not maxLength: xgrammar 0.2.9's maxLength rule lets raw control
# characters into a string, which a strict JSON parser refuses (structured_output.py).
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "pattern": NAME},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "pet": {"enum": ["cat", "dog", "owl"]},
    "friends": {"type": "array", "items": {"type": "string", "pattern": NAME}, "maxItems": 3}},
    "required": ["name", "age", "pet", "friends"], "additionalProperties": False}
RESPONSE_FORMAT = {"type": "json_schema",
                   "json_schema": {"name": "character", "schema": SCHEMA, "strict": True}}
REGEX = r"[A-Z][a-z]{2,8} (is|was) [0-9]{1,2} years old\."
GRAMMAR = 'root ::= greeting " " name "!"\ngreeting ::= "hello" | "hi"\nname ::= [a-z]{1,8}'
GRAMMAR_REGEX = r"(hello|hi) [a-z]{1,8}!"
CHOICES = ["cat", "dog", 'a "quoted" fox', "émeu"]
SEEDS = range(10)


@pytest.fixture(scope="module")
def server():
    with serve(AsyncLLM(), MODEL) as url:
        yield SimpleNamespace(url=url, client=openai.OpenAI(base_url=url + "/v1", api_key="EMPTY",
                                                            max_retries=0))


def parallel(fn, args):
    with ThreadPoolExecutor(len(args)) as pool:
        return list(pool.map(fn, args))


def chat(server, stream=False, **kwargs):
    """The reply's text and finish_reason, streamed or not."""
    reply = server.client.chat.completions.create(model=MODEL, messages=STORY, max_tokens=120,
                                                  stream=stream, **kwargs)
    if not stream:
        return reply.choices[0].message.content, reply.choices[0].finish_reason
    chunks = [c for c in reply if c.choices]
    return "".join(c.choices[0].delta.content or "" for c in chunks), chunks[-1].choices[0].finish_reason


def test_json_schema_validates_over_ten_seeds_streamed_too(server):
    """A story model at temperature 1.0 still writes JSON that validates, each seed; the stream
    carries the same text."""
    replies = parallel(lambda s: chat(server, temperature=1.0, seed=s,
                                      response_format=RESPONSE_FORMAT), list(SEEDS))
    streamed = parallel(lambda s: chat(server, stream=True, temperature=1.0, seed=s,
                                       response_format=RESPONSE_FORMAT), list(SEEDS))
    assert streamed == replies
    for text, finish_reason in replies:
        assert finish_reason == "stop", text
        jsonschema.validate(json.loads(text), SCHEMA)
    assert len({text for text, _ in replies}) > 1           # the seeds do differ


def test_completions_json_schema_and_json_object(server):
    reply = server.client.completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=120, temperature=0.0,
        extra_body={"response_format": RESPONSE_FORMAT}).choices[0]
    assert reply.finish_reason == "stop"
    jsonschema.validate(json.loads(reply.text), SCHEMA)
    # json_object: any object. The story model writes stories as keys, so a short reply ends
    # at max_tokens; each reply is still an object's opening, and those that end, parse.
    replies = parallel(lambda s: server.client.completions.create(
        model=MODEL, prompt="{", max_tokens=60, temperature=1.0, seed=s,
        extra_body={"structured_outputs": {"json_object": True}}).choices[0], list(SEEDS))
    assert all(r.text.startswith("{") for r in replies)
    ended = [r for r in replies if r.finish_reason == "stop"]
    assert all(isinstance(json.loads(r.text), dict) for r in ended)


def test_choice_regex_and_grammar_always_match(server):
    """Every seed's answer is one of the choices / matches the regex / parses with the grammar,
    and ends with "stop" when its grammar is complete, even under ignore_eos."""
    def complete(seed, structured, **extra):
        reply = server.client.completions.create(
            model=MODEL, prompt="Once upon a time", max_tokens=40, temperature=1.0, seed=seed,
            extra_body={"structured_outputs": structured, **extra}).choices[0]
        return reply.text, reply.finish_reason
    choices = parallel(lambda s: complete(s, {"choice": CHOICES}, ignore_eos=True), list(SEEDS))
    assert all(text in CHOICES and reason == "stop" for text, reason in choices), choices
    regexes = parallel(lambda s: complete(s, {"regex": REGEX}), list(SEEDS))
    assert all(re.fullmatch(REGEX, t) and r == "stop" for t, r in regexes), regexes
    grammars = parallel(lambda s: complete(s, {"grammar": GRAMMAR}), list(SEEDS))
    assert all(re.fullmatch(GRAMMAR_REGEX, t) and r == "stop" for t, r in grammars), grammars
    import xgrammar
    from nanoserve.structured_output import compile_grammar, grammar_compiler
    from nanoserve.config import DEFAULT_MODEL
    from nanoserve.model_loader import resolve_model_path
    compiled = compile_grammar(grammar_compiler(str(resolve_model_path(DEFAULT_MODEL)), 1479),
                               StructuredOutputsParams(grammar=GRAMMAR))
    for text, _ in grammars:
        matcher = xgrammar.GrammarMatcher(compiled)
        assert matcher.accept_string(text) and matcher.is_completed(), text
    streamed = chat(server, stream=True, temperature=0.0, extra_body={"structured_outputs": {
        "regex": REGEX}})
    assert re.fullmatch(REGEX, streamed[0]) and streamed[1] == "stop"
    # logprobs stay the model's own: finite, so the JSON carries them (a masked one is -inf)
    reply = server.client.chat.completions.create(
        model=MODEL, messages=STORY, max_tokens=8, temperature=0.0, logprobs=True, top_logprobs=3,
        extra_body={"structured_outputs": {"choice": ["yes", "no"]}}).choices[0]
    assert reply.message.content in ("yes", "no")
    assert all(-1e4 < top.logprob <= 0 for entry in reply.logprobs.content
               for top in entry.top_logprobs)


@pytest.mark.parametrize("body, param, words", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "foo"}}}}, "response_format", "JSON schema is not valid"),
    ({"structured_outputs": {"json": "{not json"}}, "structured_outputs", "JSON schema"),
    ({"structured_outputs": {"regex": "(abc"}}, "structured_outputs", "regex is not valid"),
    ({"structured_outputs": {"grammar": "root ::= undefined_rule"}}, "structured_outputs",
     "EBNF grammar is not valid"),
    ({"structured_outputs": {"grammar": "root ::= root"}}, "structured_outputs", "matches no text"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs", "choice"),
    ({"structured_outputs": {"choice": ["a"], "regex": "a"}}, "structured_outputs", "exactly one"),
    ({"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}},
     "structured_outputs", "send one of them"),
    ({"structured_outputs": {"guided_json": {}}}, "structured_outputs", "not supported"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format", "'schema' object"),
    ({"response_format": {"type": "yaml"}}, "response_format", "response_format.type"),
    ({"structured_outputs": {"regex": "a"}, "min_tokens": 2}, "min_tokens", "min_tokens"),
])
@pytest.mark.parametrize("stream", [False, True])
def test_bad_structured_output_is_400_naming_the_field(server, body, param, words, stream):
    with pytest.raises(openai.BadRequestError) as info:
        server.client.completions.create(model=MODEL, prompt="hi", max_tokens=4, stream=stream,
                                         extra_body=body)
    error = info.value.response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert words in error["message"], error


def test_a_grammar_that_corners_itself_ends_its_request_alone(server):
    """After "a" this grammar allows no token at all: that request stops there, and a plain
    request in the same steps is not failed with it."""
    def complete(structured):
        return server.client.completions.create(
            model=MODEL, prompt="Once upon a time", max_tokens=16, temperature=0.0,
            extra_body={"structured_outputs": structured} if structured else {}).choices[0]
    cornered, plain = parallel(complete, [{"grammar": 'root ::= "a" x\nx ::= x'}, None])
    assert (cornered.text, cornered.finish_reason) == ("a", "stop")
    assert plain.finish_reason == "length" and plain.text


def test_offline_llm_takes_structured_outputs_through_sampling_params():
    llm = LLM(max_model_len=256, num_kv_blocks=64)
    params = SamplingParams(temperature=0.0, max_tokens=120,
                            structured_outputs=StructuredOutputsParams(json=SCHEMA))
    out = llm.generate("Once upon a time", params, progress=False)[0].outputs[0]
    assert out.finish_reason == "stop", out
    jsonschema.validate(json.loads(out.text), SCHEMA)
    with pytest.raises(ValueError, match="structured_outputs: the regex is not valid"):
        llm.generate("hi", SamplingParams(structured_outputs=StructuredOutputsParams(
            regex="[z-a]")), progress=False)
    assert not llm.engine.has_unfinished_requests()


def structured_workload():
    """Eight structured requests (each kind, seeded at temperature 1.0) and four greedy plain ones."""
    kinds = [dict(json=SCHEMA), dict(regex=REGEX), dict(choice=CHOICES), dict(grammar=GRAMMAR)]
    structured = [SamplingParams(temperature=1.0, seed=i, max_tokens=80,
                                 structured_outputs=StructuredOutputsParams(**kinds[i % 4]))
                  for i in range(8)]
    plain = [SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)] * 4
    prompts = ["Once upon a time", "The little owl", "Tom and Lily", "One day"]
    return [prompts[i % 4] for i in range(8)] + prompts, structured + plain


def valid(i: int, text: str) -> bool:
    """Whether request i of structured_workload() wrote what its kind asks for."""
    if i % 4 == 0:
        jsonschema.validate(json.loads(text), SCHEMA)
        return True
    return bool(text in CHOICES if i % 4 == 2 else
                re.fullmatch(REGEX if i % 4 == 1 else GRAMMAR_REGEX, text))


def check_structured(outs) -> None:
    for i, out in enumerate(outs[:8]):
        assert out.outputs[0].finish_reason == "stop" and valid(i, out.outputs[0].text), out


def test_mixed_batch_leaves_plain_requests_unchanged_and_the_trace_counts_it(tmp_path, capsys,
                                                                             monkeypatch):
    """Plain greedy requests batched with structured ones give the tokens they give alone; the
    trace says which steps masked which request, and `nanoserve trace --summary` counts them."""
    prompts, params = structured_workload()
    alone = LLM(max_model_len=256, num_kv_blocks=64).generate(prompts[8:], params[8:],
                                                                progress=False)
    path = str(tmp_path / "mixed.jsonl")
    mixed = LLM(max_model_len=256, num_kv_blocks=64, trace=path).generate(prompts, params,
                                                                          progress=False)
    assert [o.outputs[0].token_ids for o in mixed[8:]] == [o.outputs[0].token_ids for o in alone]
    check_structured(mixed)
    trace = Trace.load(path)
    requests = list(trace.requests.values())        # ids 0..11 in the order given
    for i, (r, out) in enumerate(zip(requests, mixed)):      # every sampling step of a
        assert r.masked_steps == (r.token_steps if i < 8 else [])   # structured one, no other
        assert len(r.token_steps) == len(out.outputs[0].token_ids)
    shared = {s for r in requests[:8] for s in r.masked_steps} & set(requests[8].work)
    assert shared, "the plain and structured requests never shared a step"
    from nanoserve import cli
    monkeypatch.setenv("COLUMNS", "200")        # the summary table on one line per row
    cli.main(["trace", path, "--summary"])
    masked = sum(len(r.masked_steps) for r in requests)
    assert f"8 requests, {masked} request-steps masked by their grammar" in capsys.readouterr().out


def test_preemption_keeps_each_grammar_where_it_was(tmp_path):
    """A pool too small for the batch preempts structured requests mid-grammar; they resume with
    their matchers as they were: the same tokens as with a pool that never preempts, all valid."""
    prompts, params = structured_workload()
    roomy = LLM(max_model_len=256, num_kv_blocks=64).generate(prompts, params, progress=False)
    # The plain requests first: the last admitted are preempted first, so the structured are.
    small = LLM(max_model_len=128, block_size=16, num_kv_blocks=10, trace=str(tmp_path / "t.jsonl"))
    tight = small.generate(prompts[8:] + prompts[:8], params[8:] + params[:8], progress=False)
    tight = tight[4:] + tight[:4]
    small.engine.tracer.flush()
    structured = list(Trace.load(str(tmp_path / "t.jsonl")).requests.values())[4:]
    assert any(s > min(r.masked_steps) for r in structured for s in r.preempt_steps)  # mid-grammar
    assert [o.outputs[0].token_ids for o in tight] == [o.outputs[0].token_ids for o in roomy]
    check_structured(tight)
    assert small.engine.kv_cache_manager.pool.num_free_blocks == 10
    assert not small.engine.structured_output.matchers


def test_tensor_parallel_applies_the_mask_on_rank_0():
    prompts, params = structured_workload()
    tp1 = LLM(max_model_len=256, num_kv_blocks=64).generate(prompts, params, progress=False)
    tp2 = LLM(max_model_len=256, num_kv_blocks=64, tensor_parallel_size=2).generate(
        prompts, params, progress=False)
    assert [o.outputs[0].token_ids for o in tp2] == [o.outputs[0].token_ids for o in tp1]
    check_structured(tp2)


def test_apply_grammar_bitmask_masks_exactly_the_forbidden_tokens():
    """Against the bit layout spelled out per token: row r allows token t when bit t % 32 of
    word t // 32 is set; rows without a grammar keep every logit (whatever their bitmask row)."""
    torch.manual_seed(0)
    vocab, rows = 1479, [4, 0, 2]
    logits = torch.randn(6, vocab)
    bitmask = torch.randint(-2**31, 2**31 - 1, (6, (vocab + 31) // 32), dtype=torch.int32)
    masked = apply_grammar_bitmask(logits.clone(), bitmask, rows)
    words = bitmask.tolist()
    for r in range(6):
        row_bits = words[r] if r in rows else None
        for t in range(vocab):
            allowed = row_bits is None or (row_bits[t // 32] >> (t % 32)) & 1
            assert masked[r, t] == (logits[r, t] if allowed else float("-inf")), (r, t)


def test_speculation_drafts_for_plain_requests_only_and_changes_no_token():
    """With n-gram speculation on, structured requests get no drafts (their matcher would have
    to mask each draft's row), plain ones still do: every token equals the run without it."""
    prompts, params = structured_workload()
    plain = LLM(max_model_len=256, num_kv_blocks=64).generate(prompts, params, progress=False)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
            "prompt_lookup_max": 3}
    llm = LLM(max_model_len=256, num_kv_blocks=64, debug=2, speculative_config=spec)
    drafted = llm.generate(prompts, params, progress=False)
    assert [o.outputs[0].token_ids for o in drafted] == [o.outputs[0].token_ids for o in plain]
    check_structured(drafted)
    assert llm.engine.get_stats()["spec_decode_num_drafts_total"] > 0    # the plain ones drafted
