"""protocol.py: the OpenAI request schemas the server accepts, and OpenAI's error JSON.

Each endpoint's body is checked field by field against a small schema (field -> JSON type, e.g.
"string | array of integer"); an unknown field, a wrong type or a missing required field is an
`APIError` (HTTP 400) naming the field. The values' ranges are SamplingParams' to check.

    >>> parse_body({"model": "m", "prompt": "hi", "n": 2}, COMPLETION_FIELDS, ("model", "prompt"))["n"]
    2

Lesson: lessons/01-the-map.md
"""

from __future__ import annotations

from typing import Optional

from starlette.responses import JSONResponse

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


def sampling_params_of(body: dict, **overrides) -> SamplingParams:
    if is_int(body.get("n")) and body["n"] > MAX_N:
        raise APIError(400, f"n must be <= {MAX_N} (got {body['n']})", "n")
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
