"""The HTTP protocol ``autotune serve`` runs: uvicorn's h11 protocol with the two limits uvicorn
lacks. A connection beyond ``AUTOTUNE_MAX_CONNECTIONS`` gets a 503 and is closed at once (so
idle connections cannot exhaust the file descriptors), and a client that has not sent a whole
request within ``AUTOTUNE_READ_TIMEOUT_S`` of connecting (or of its previous response) is
disconnected (slowloris: idle or half-sent requests). Neither writes a log line."""

from __future__ import annotations

import asyncio
from functools import cache
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from api.settings import ApiSettings

_BUSY = b'{"detail": "too many connections; retry in a few seconds"}'
_OVERLOADED = (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
               b"connection: close\r\ncontent-length: %d\r\n\r\n%s" % (len(_BUSY), _BUSY))
_WAITING = (h11.IDLE, h11.SEND_BODY)  # their states before a whole request has arrived


@cache
def read_timeout_s() -> float:
    """``AUTOTUNE_READ_TIMEOUT_S`` of this process (worker processes inherit the variable)."""
    return ApiSettings().read_timeout_s


class LimitedH11Protocol(H11Protocol):
    """One connection; ``config.limit_concurrency`` is the connection limit."""

    _read_deadline: asyncio.TimerHandle | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # uvicorn's own check would refuse every request (plain text, logged) while the limit's
        # number of connections is open: the limit is counted here, per connection, instead.
        self.limit_concurrency = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        limit = self.config.limit_concurrency
        if limit is not None and len(self.connections) > limit:
            transport.write(_OVERLOADED)
            transport.close()
            return
        self._start_read_deadline()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state not in _WAITING:
            self._cancel_read_deadline()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._start_read_deadline()  # for the next request on this connection

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_read_deadline()
        super().connection_lost(exc)

    def _start_read_deadline(self) -> None:
        self._cancel_read_deadline()
        self._read_deadline = self.loop.call_later(read_timeout_s(), self._read_timed_out)

    def _cancel_read_deadline(self) -> None:
        if self._read_deadline is not None:
            self._read_deadline.cancel()
            self._read_deadline = None

    def _read_timed_out(self) -> None:
        self._read_deadline = None
        if self.conn.their_state in _WAITING and not self.transport.is_closing():
            self.transport.close()
