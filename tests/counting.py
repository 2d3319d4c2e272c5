"""A TCP relay in front of the test Redis that records every command its clients send.

It parses the RESP requests going to Redis (each command is an array of bulk strings), so a
test can assert how many commands, and which, one call sent: round trips counted on the wire,
without ``MONITOR`` and without mixing in the commands a Lua script runs on the server.

``flights`` groups them by round trip: what a client sends before Redis next answers it on that
connection is one flight (a pipeline is one). ``connections`` counts the connections accepted.
"""

from __future__ import annotations

import socket
import threading

from tests.harness import free_port


class _Link:
    """One client connection: has Redis answered since the client last sent?"""

    def __init__(self) -> None:
        self.answered = True


class CommandCounter:
    """Relays to Redis on ``upstream_port``; ``commands`` lists the names sent (upper case),
    ``flights`` the commands of each round trip."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.port = free_port()
        self.commands: list[str] = []
        self.flights: list[list[str]] = []
        self.connections = 0
        self._guard = threading.Lock()
        self._sock = socket.create_server(("127.0.0.1", self.port))
        self._closed = False
        self._conns: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def take(self) -> list[str]:
        """The commands recorded since the last call (and forget them)."""
        with self._guard:
            taken, self.commands = self.commands, []
        return taken

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._sock.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.upstream_port))
            self._conns += [client, upstream]
            link = _Link()
            with self._guard:
                self.connections += 1
            threading.Thread(
                target=self._requests, args=(client, upstream, link), daemon=True
            ).start()
            threading.Thread(target=self._pump, args=(upstream, client, link), daemon=True).start()

    def take_flights(self) -> tuple[list[list[str]], int]:
        """The round trips and the connections recorded since the last call (and forget them)."""
        with self._guard:
            taken, self.flights = self.flights, []
            connections, self.connections = self.connections, 0
        return taken, connections

    def _requests(self, client: socket.socket, upstream: socket.socket, link: _Link) -> None:
        buffer = b""
        flight: list[str] = []
        while True:
            try:
                data = client.recv(65536)
                if not data:
                    break
                if link.answered:  # a new round trip
                    link.answered = False
                    flight = []
                    with self._guard:
                        self.flights.append(flight)
                buffer = self._record(buffer + data, flight)
                upstream.sendall(data)
            except OSError:
                break
        _close(client, upstream)

    def _record(self, buffer: bytes, flight: list[str]) -> bytes:
        """Record every complete command at the start of ``buffer``; return the rest."""
        while True:
            parsed = _parse_command(buffer)
            if parsed is None:
                return buffer
            name, buffer = parsed
            with self._guard:
                self.commands.append(name)
                flight.append(name)

    def _pump(self, src: socket.socket, dst: socket.socket, link: _Link) -> None:
        while True:
            try:
                data = src.recv(65536)
                if not data:
                    break
                link.answered = True  # before the client can send its next round trip
                dst.sendall(data)
            except OSError:
                break
        _close(src, dst)

    def close(self) -> None:
        self._closed = True
        self._sock.close()
        _close(*self._conns)


def _parse_command(buffer: bytes) -> tuple[str, bytes] | None:
    """(command name, rest) for one complete RESP array at the start of ``buffer``, else None."""
    if not buffer.startswith(b"*"):
        if buffer:
            raise AssertionError(f"not a RESP command: {buffer[:40]!r}")
        return None
    end = buffer.find(b"\r\n")
    if end < 0:
        return None
    count, position, name = int(buffer[1:end]), end + 2, ""
    for index in range(count):
        end = buffer.find(b"\r\n", position)
        if end < 0:
            return None
        length = int(buffer[position + 1 : end])
        start, position = end + 2, end + 2 + length + 2
        if position > len(buffer):
            return None
        if index == 0:
            name = buffer[start : start + length].decode().upper()
    return name, buffer[position:]


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
