"""A fake e-mail / API provider over real HTTP, for tests and the demo of the outbox.

:class:`FakeProvider` listens on ``127.0.0.1`` (a free port) in a thread of the process that
starts it and records every ``POST`` it is sent: its ``Idempotency-Key`` header and JSON body.
Like a real provider that honours the header (Stripe's, Postmark's message ids), it performs
a key's effect once: :attr:`~FakeProvider.sends` counts effects (distinct keys, plus every call
without a key), :attr:`~FakeProvider.calls` every request. Setting ``fail_next`` makes the next
requests answer ``503`` (a provider outage). :func:`post` is the client side: the call a
handler of :func:`django_joblock.send_after_commit` makes.
"""

from __future__ import annotations

import json
import threading
import urllib.request
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

__all__ = ["Call", "FakeProvider", "post"]


@dataclass(frozen=True)
class Call:
    """One request the provider received (``key`` is ``""`` without the header)."""

    key: str
    body: Any


class FakeProvider:
    """An HTTP provider in a background thread (see the module docs); a context manager."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._calls: list[Call] = []
        self.fail_next = 0  # answer this many requests with 503 before accepting again
        provider = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length) or b"null")
                status = provider._receive(Call(self.headers.get("Idempotency-Key", ""), body))
                self.send_response(status)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:  # quiet: tests read the records
                return

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}/send"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def _receive(self, call: Call) -> int:
        with self._lock:
            if self.fail_next > 0:
                self.fail_next -= 1
                return 503
            self._calls.append(call)
            return 200

    @property
    def calls(self) -> list[Call]:
        """Every accepted request, in arrival order."""
        with self._lock:
            return list(self._calls)

    @property
    def sends(self) -> int:
        """Effects performed: one per distinct key, plus one per call without a key."""
        calls = self.calls
        return len({c.key for c in calls if c.key}) + sum(1 for c in calls if not c.key)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def __enter__(self) -> FakeProvider:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def post(url: str, body: Any, *, idempotency_key: str = "", timeout: float = 5.0) -> None:
    """POST ``body`` as JSON to ``url`` (with the ``Idempotency-Key`` header when given);
    raises ``urllib.error.URLError`` / ``HTTPError`` when the provider does not accept it."""
    headers = {"Content-Type": "application/json"}
    if idempotency_key:
        headers["Idempotency-Key"] = idempotency_key
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers=headers, method="POST"
    )
    with urllib.request.urlopen(request, timeout=timeout) as response:
        response.read()
