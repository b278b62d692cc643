"""errors.py: the engine's exceptions, in one module, so every layer raises and catches the same
classes (and a user catches them with one import):

    from nanoserve.errors import EngineDeadError, EngineOverloadedError

- `EngineOverloadedError`, `RequestTimeoutError`: AsyncLLM (engine.py) refuses or ends one request.
- `EngineStepError`: one step failed (engine_core.py); its requests fail, the engine goes on.
- `EngineDeadError`: the engine core stopped (its loop failed, or its process died, or a step hit
  an error the device cannot recover from: `is_fatal_step_error`): nothing runs.
- `WorkerError`: a tensor-parallel worker failed or died (executor.py); the executor is
  unusable from then on, so it ends the engine too (`is_fatal_step_error`).

A request that can never run is a plain ValueError naming the field (Processor, processor.py).
The HTTP layer's `APIError` (OpenAI's error JSON and a status code) is not here: it belongs to
the server, so it stays in protocol.py, which maps these errors onto it (`api_error_of`).
Plain classes that import nothing of nanoserve (any layer may import them). They cross from
the engine core's process to the API server's as (class name, message), rebuilt from a fixed
list (serial_utils.WIRE_ERRORS): a new class needs its place there, or arrives as its base.
"""

from __future__ import annotations

from typing import Sequence


class EngineOverloadedError(RuntimeError):
    """max_waiting_requests requests are waiting already: the server answers 503 + Retry-After."""


class RequestTimeoutError(RuntimeError):
    """The request ran past request_timeout_s and was aborted."""


class EngineStepError(RuntimeError):
    """A step failed; `request_ids` were in it and have been aborted (the engine goes on).
    (It crosses to the API server's process as its message alone.)"""

    def __init__(self, message: str, request_ids: Sequence[str] = ()):
        super().__init__(message)
        self.request_ids = list(request_ids)


class EngineDeadError(RuntimeError):
    """The engine core stopped (an error in its loop, or its process died): nothing will run."""


class WorkerError(RuntimeError):
    """A worker process failed or died; the executor is unusable from then on."""


# What a CUDA error's message says: after one the device's context is unusable, so every later
# kernel fails too. torch >= 2.8 raises torch.AcceleratorError; older ones a plain RuntimeError.
FATAL_DEVICE_ERRORS = ("CUDA error", "device-side assert", "illegal memory access")


def is_fatal_step_error(e: BaseException) -> bool:
    """Whether a step's error ends the engine (EngineDeadError), not just that step: a CUDA error,
    or a tensor-parallel worker lost (WorkerError: its executor is unusable from then on)."""
    import torch   # here, not at the top: the API server imports this module and never torch
    accelerator_error = getattr(torch, "AcceleratorError", ())
    return (isinstance(e, (WorkerError, accelerator_error))
            or (isinstance(e, RuntimeError) and any(s in str(e) for s in FATAL_DEVICE_ERRORS)))
