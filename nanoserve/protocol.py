"""protocol.py: the OpenAI request schemas the server accepts, and OpenAI's error JSON (the
engine's errors mapped onto it: `api_error_of`).

A body is strict JSON (`loads_body`: no NaN or Infinity, nested at most MAX_JSON_DEPTH deep),
checked field by field against a small schema (field -> JSON type, e.g.
"string | array of integer"); an unknown field, a wrong type or a missing required field is an
`APIError` (HTTP 400) naming the field. The values' ranges are SamplingParams' to check.

    >>> parse_body({"model": "m", "prompt": "hi", "n": 2}, COMPLETION_FIELDS, ("model", "prompt"))["n"]
    2

Lesson: lessons/01-the-map.md
"""

from __future__ import annotations

import json
import re
from typing import Optional

import numpy as np
from starlette.responses import JSONResponse

from nanoserve.errors import EngineOverloadedError, RequestTimeoutError
from nanoserve.sampling_params import SamplingParams, StructuredOutputsParams, is_int, is_num


class APIError(Exception):
    """An error the client gets as OpenAI's JSON: {"error": {message, type, param, code}}."""

    def __init__(self, status: int, message: str, param: Optional[str] = None, code=None,
                 headers: Optional[dict] = None):
        super().__init__(message)
        self.status, self.param, self.code, self.headers = status, param, code, headers

    def response(self) -> JSONResponse:
        kind = "server_error" if self.status >= 500 else "invalid_request_error"
        return JSONResponse({"error": {"message": str(self), "type": kind, "param": self.param,
                                       "code": self.code}}, status_code=self.status,
                            headers=self.headers)


MAX_N = 128     # completions per prompt: OpenAI's own bound
# Stop strings are searched for in every new piece of every choice's text: 64 strings of 1,024
# characters each is 16 times OpenAI's limit of 4 and far above what clients send, yet keeps that
# search small. stop_token_ids get the same count (the scheduler tests each new token against them).
MAX_STOP, MAX_STOP_CHARS = 64, 1024
MAX_JSON_DEPTH = 64     # a response_format schema takes 2 levels per object in it: ~30 fit


# -- the body: strict JSON, shallow --------------------------------------------------------
_BRACKET_STEP = np.zeros(256, np.int8)
_BRACKET_STEP[list(b"[{")], _BRACKET_STEP[list(b"]}")] = 1, -1


def json_depth(raw: bytes) -> int:
    """How deep a JSON text nests arrays and objects, without parsing it: brackets inside strings
    do not count (escaped characters dropped first, then each quote flips in/out of a string).
    Vectorized: an 8 MiB body takes a fraction of a second, never a deep recursion."""
    text = np.frombuffer(raw.replace(b"\\\\", b"").replace(b'\\"', b""), np.uint8)
    outside = np.bitwise_xor.accumulate(text == ord('"')) == 0
    return int(np.cumsum(_BRACKET_STEP[text] * outside, dtype=np.int32).max(initial=0))


def _refuse_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def loads_body(raw: bytes):
    """The request body's JSON; APIError 400 for text that is not strict JSON (NaN, Infinity and
    -Infinity are Python's extensions) or nests deeper than MAX_JSON_DEPTH (no RecursionError)."""
    if raw.count(b"[") + raw.count(b"{") > MAX_JSON_DEPTH and json_depth(raw) > MAX_JSON_DEPTH:
        raise APIError(400, f"the request body nests deeper than {MAX_JSON_DEPTH} levels")
    try:
        return json.loads(raw, parse_constant=_refuse_constant)
    except ValueError as e:           # not JSON, not UTF-8, or NaN / Infinity
        raise APIError(400, f"the request body is not valid JSON: {e}") from None


# -- request schemas: field -> JSON type ("array of t", "a | b") ---------------------------
_SAMPLING = {"n": "integer", "temperature": "number", "top_p": "number", "top_k": "integer",
             "min_p": "number", "seed": "integer", "max_tokens": "integer",
             "min_tokens": "integer", "stop": "string | array of string",
             "stop_token_ids": "array of integer", "ignore_eos": "boolean",
             "presence_penalty": "number", "frequency_penalty": "number",
             "repetition_penalty": "number"}
_COMMON = {"model": "string", "stream": "boolean", "stream_options": "object", "user": "string",
           "response_format": "object", "structured_outputs": "object", **_SAMPLING}
COMPLETION_FIELDS = {**_COMMON, "echo": "boolean", "logprobs": "integer", "prompt": "string | "
                     "array of string | array of integer | array of array of integer"}
CHAT_FIELDS = {**_COMMON, "messages": "array of object", "logprobs": "boolean",
               "top_logprobs": "integer", "max_completion_tokens": "integer"}
_CHECKS = {"integer": is_int, "number": is_num, "boolean": lambda v: isinstance(v, bool),
           "string": lambda v: isinstance(v, str), "object": lambda v: isinstance(v, dict)}


def is_type(value, kind: str) -> bool:
    if " | " in kind:
        return any(is_type(value, k) for k in kind.split(" | "))
    if kind.startswith("array of "):
        return isinstance(value, list) and all(is_type(v, kind[len("array of "):]) for v in value)
    return _CHECKS[kind](value)


def parse_body(body, schema: dict, required: tuple[str, ...]) -> dict:
    """The body's fields, type-checked; an explicit null counts as absent."""
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    for name, value in body.items():
        if name not in schema:
            raise APIError(400, f"unsupported field {name!r}", name)
        if value is not None and not is_type(value, schema[name]):
            raise APIError(400, f"{name} must be: {schema[name]} (got {value!r:.80})", name)
    for name in required:
        if not body.get(name):
            raise APIError(400, f"{name} is required and must not be empty", name)
    return {name: value for name, value in body.items() if value is not None}


def param_of(error: Exception) -> Optional[str]:
    """The field a ValueError names ("top_p must be in (0, 1] ..." -> "top_p"), if any."""
    word = str(error).split(" ", 1)[0]
    return word if word in COMPLETION_FIELDS or word in CHAT_FIELDS else None


# The ids api.py gives requests ("cmpl-<hex>"), as the engine's messages may hold them: a
# prompt's ("-0"), a choice's ("3_").
_REQUEST_ID = re.compile(r"(?:\d+_)?(?:chatcmpl|cmpl)-[0-9a-f]{32}(?:-\d+)?")


def own_ids_only(message: str, request_id: Optional[str] = None) -> str:
    """An engine error's text may name any request of a failed step: keep the client's own
    (`request_id`), and say "another request" for the others'."""
    return _REQUEST_ID.sub(lambda m: m.group() if request_id and request_id in m.group()
                           else "another request", message)


def api_error_of(e: Exception, request_id: str) -> APIError:
    """400: refused up front; 408: over request_timeout_s; 500: a failed step (the engine goes
    on), the engine (a data-parallel rank) stopped under the request, or any other error of this
    request alone; 503: too many waiting (retry soon). A request that comes once the engine has
    stopped is a 503 (api.py)."""
    if isinstance(e, EngineOverloadedError):
        return APIError(503, str(e), code="overloaded", headers={"Retry-After": "1"})
    status = {ValueError: 400, RequestTimeoutError: 408}.get(type(e), 500)
    return APIError(status, own_ids_only(str(e), request_id), param_of(e))


def sampling_params_of(body: dict, **overrides) -> SamplingParams:
    if is_int(body.get("n")) and body["n"] > MAX_N:
        raise APIError(400, f"n must be <= {MAX_N} (got {body['n']})", "n")
    stop = [body["stop"]] if isinstance(body.get("stop"), str) else body.get("stop") or []
    for name, values in (("stop", stop), ("stop_token_ids", body.get("stop_token_ids") or [])):
        if len(values) > MAX_STOP:
            raise APIError(400, f"{name} must hold at most {MAX_STOP} items (got {len(values)})",
                           name)
    if any(len(s) > MAX_STOP_CHARS for s in stop):
        raise APIError(400, f"stop strings must be at most {MAX_STOP_CHARS} characters", "stop")
    structured = structured_outputs_of(body)
    try:
        return SamplingParams(**{**{k: body[k] for k in _SAMPLING if k in body},
                                 "structured_outputs": structured, **overrides})
    except ValueError as e:
        raise APIError(400, str(e), param_of(e)) from None


# -- structured outputs: OpenAI's response_format, vLLM's structured_outputs -----------------
_STRUCTURED = {"json": "object | string", "regex": "string", "choice": "array of string",
               "grammar": "string", "json_object": "boolean"}


def structured_outputs_of(body: dict) -> Optional[StructuredOutputsParams]:
    """`response_format` {"type": "json_schema", "json_schema": {"name", "schema", "strict"}}
    or {"type": "json_object"} (OpenAI's), or `structured_outputs` {"choice": [...]}, {"regex"},
    {"json"}, {"grammar"}, {"json_object"} (vLLM's), as one StructuredOutputsParams; None for
    neither (or {"type": "text"}). Asking for two at once is a 400 naming the field."""
    fmt, structured = body.get("response_format"), body.get("structured_outputs")
    kind = fmt.get("type") if fmt is not None else None
    if fmt is not None and kind not in ("text", "json_object", "json_schema"):
        raise APIError(400, "response_format.type must be 'text', 'json_object' or 'json_schema' "
                       f"(got {kind!r:.80})", "response_format")
    if structured is not None and kind in ("json_object", "json_schema"):
        raise APIError(400, "structured_outputs and response_format each ask for a structured "
                       "output: send one of them", "structured_outputs")
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind == "json_schema":
        return StructuredOutputsParams(json=_json_schema_of(fmt.get("json_schema")))
    if structured is None:
        return None
    for name, value in structured.items():
        if name not in _STRUCTURED:
            raise APIError(400, f"structured_outputs.{name} is not supported (supported: "
                           f"{', '.join(_STRUCTURED)})", "structured_outputs")
        if value is not None and not is_type(value, _STRUCTURED[name]):
            raise APIError(400, f"structured_outputs.{name} must be: {_STRUCTURED[name]} "
                           f"(got {value!r:.80})", "structured_outputs")
    try:
        return StructuredOutputsParams(**structured)
    except ValueError as e:       # none or several of json, regex, choice, grammar, json_object
        raise APIError(400, str(e), "structured_outputs") from None


def _json_schema_of(spec) -> dict:
    """The schema of response_format.json_schema. `strict` is accepted and always honoured: the
    output follows the schema whatever it says (xgrammar's strict mode, as in vLLM: no property
    the schema does not name, unless it allows extra ones itself)."""
    if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
        raise APIError(400, "response_format.json_schema must be an object with a 'schema' object",
                       "response_format")
    if not isinstance(spec.get("strict", False), (bool, type(None))):
        raise APIError(400, "response_format.json_schema.strict must be a boolean", "response_format")
    return spec["schema"]
