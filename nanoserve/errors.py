"""errors.py: the engine's exceptions, in one module, so every layer raises and catches the same
classes (and a user catches them with one import):

    from nanoserve.errors import EngineDeadError, EngineOverloadedError

- `EngineOverloadedError`, `RequestTimeoutError`: AsyncLLM (engine.py) refuses or ends one request.
- `EngineStepError`: one step failed (engine_core.py); its requests fail, the engine goes on.
- `EngineDeadError`: the engine core stopped (its loop failed, or its process died): nothing runs.
- `WorkerError`: a tensor-parallel worker failed or died (executor.py); the step fails with it.

A request that can never run is a plain ValueError naming the field (Processor, engine.py).
The HTTP layer's `APIError` (OpenAI's error JSON and a status code) is not here: it belongs to
the server, so it stays in protocol.py, and api.py maps these errors onto it (`_api_error`).
Plain classes that import nothing of nanoserve (any layer may import them), and they pickle:
they cross from the engine core's process to the API server's.
"""

from __future__ import annotations

from typing import Sequence


class EngineOverloadedError(RuntimeError):
    """max_waiting_requests requests are waiting already: the server answers 503 + Retry-After."""


class RequestTimeoutError(RuntimeError):
    """The request ran past request_timeout_s and was aborted."""


class EngineStepError(RuntimeError):
    """A step failed; `request_ids` were in it and have been aborted (the engine goes on).
    (Its args are the message alone, so it pickles: it crosses to the API server's process.)"""

    def __init__(self, message: str, request_ids: Sequence[str] = ()):
        super().__init__(message)
        self.request_ids = list(request_ids)


class EngineDeadError(RuntimeError):
    """The engine core stopped (an error in its loop, or its process died): nothing will run."""


class WorkerError(RuntimeError):
    """A worker process failed or died; the executor is unusable from then on."""
