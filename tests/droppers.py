"""A TCP relay in front of the test Redis that loses one reply on purpose.

Unlike the harness proxy (which delays or holds bytes), this one lets a command reach Redis and
run there, then closes the client's connection instead of passing the reply on: the client sees
"connection closed" for a command the server *did* run. That is the fault behind "an acquire
whose reply was lost".
"""

from __future__ import annotations

import socket
import threading

from tests.harness import free_port


class ReplyDropper:
    """Relays to Redis on ``upstream_port``; once armed, drops the reply to the next command
    containing ``marker`` (and closes that client connection); ``dropped`` keeps those bytes."""

    def __init__(self, upstream_port: int, marker: bytes = b"EVALSHA") -> None:
        self.upstream_port = upstream_port
        self.marker = marker
        self.port = free_port()
        self.armed = False
        self.dropped: list[bytes] = []
        self._sock = socket.create_server(("127.0.0.1", self.port))
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._sock.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.upstream_port))
            state = {"drop_next": False}
            threading.Thread(
                target=self._requests, args=(client, upstream, state), daemon=True
            ).start()
            threading.Thread(
                target=self._replies, args=(upstream, client, state), daemon=True
            ).start()

    def _requests(self, client: socket.socket, upstream: socket.socket, state: dict) -> None:
        while True:
            try:
                data = client.recv(65536)
                if not data:
                    break
                if self.armed and self.marker in data:
                    self.armed = False
                    state["drop_next"] = True
                upstream.sendall(data)
            except OSError:
                break
        _close(client, upstream)

    def _replies(self, upstream: socket.socket, client: socket.socket, state: dict) -> None:
        while True:
            try:
                data = upstream.recv(65536)
                if not data:
                    break
                if state["drop_next"]:
                    # The command ran on the server; its reply never reaches the client.
                    self.dropped.append(data)
                    break
                client.sendall(data)
            except OSError:
                break
        _close(client, upstream)

    def close(self) -> None:
        self._closed = True
        self._sock.close()


def _close(*socks: socket.socket) -> None:
    for sock in socks:
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        try:
            sock.close()
        except OSError:
            pass
