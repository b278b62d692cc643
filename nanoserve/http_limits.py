"""http_limits.py: what the HTTP server refuses before a request reaches api.py's handlers.

- Which browsers' pages may call it: none by default; `--allowed-origins` lists them (CORS,
  Starlette's CORSMiddleware, vLLM's flag name). A page on another origin cannot read an answer,
  and cannot send a JSON body without asking first (a preflight, refused); api.py answers any
  other content type with 415, so a "simple" cross-site POST runs nothing either.
- Which Host headers it answers: a server bound to loopback answers only loopback names
  (LOOPBACK_HOSTS, any port), so a web page whose DNS name is rebound to 127.0.0.1 cannot reach
  it; `--allowed-hosts` widens that (Starlette's TrustedHostMiddleware: 400 otherwise).
- How long a client may take to send a request's head (line and headers): `H11Protocol`, a
  uvicorn protocol with that deadline, which uvicorn lacks (its keep-alive timer stops at the
  first byte, so a client sending half a request line held its connection for good).
"""

from __future__ import annotations

import ipaddress
from typing import Sequence

import h11
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.middleware.trustedhost import TrustedHostMiddleware
from uvicorn.protocols.http.h11_impl import H11Protocol as UvicornH11Protocol

LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "[::1]")


def is_loopback(host: str) -> bool:
    """Whether a bind address is loopback only (127.0.0.0/8, ::1, localhost)."""
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return host == "localhost"


def http_middleware(allowed_hosts: Sequence[str], allowed_origins: Sequence[str]) -> list:
    """The Host check outermost, then CORS (only when some origin is allowed)."""
    middleware = [Middleware(TrustedHostMiddleware, allowed_hosts=list(allowed_hosts),
                             www_redirect=False)]
    if allowed_origins:
        middleware.append(Middleware(CORSMiddleware, allow_origins=list(allowed_origins),
                                     allow_methods=["*"], allow_headers=["*"]))
    return middleware


class H11Protocol(UvicornH11Protocol):
    """uvicorn's h11 protocol, closing a connection whose request head has not fully arrived
    within `timeout_request_head` seconds of the connection opening, or of its previous response
    (a slow body, or a long stream, is not its business: the client's state is past IDLE then).
    Pass `functools.partial(H11Protocol, timeout_request_head=...)` as uvicorn.Config's `http`."""

    def __init__(self, *args, timeout_request_head: float, **kwargs):
        super().__init__(*args, **kwargs)
        self.timeout_request_head = timeout_request_head
        self._head_timer = None

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._await_head()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._await_head()        # the next request on this connection gets its own deadline

    def connection_lost(self, exc) -> None:
        self._head_timer.cancel()
        super().connection_lost(exc)

    def _await_head(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
        self._head_timer = self.loop.call_later(self.timeout_request_head, self._head_timed_out)

    def _head_timed_out(self) -> None:
        if self.conn.their_state is h11.IDLE:     # h11 leaves IDLE once the whole head is in
            self.transport.close()
