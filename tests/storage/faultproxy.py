"""A TCP proxy on 127.0.0.1 in front of the S3 test server that misbehaves on request.

Modes, chosen per connection when it is accepted:

- ``pass``: bytes flow both ways unchanged;
- ``503``: the first request on the connection is read and answered ``503 Service Unavailable``,
  then the connection is closed (what an overloaded S3 front end does);
- ``drop``: the connection is reset at once (a dead node, a network partition);
- ``delay``: like ``pass`` after ``delay`` seconds (a slow network);
- ``throttle``: like ``pass`` at ``rate`` bytes per second each way (a slow, steady link);
- ``lose``: the next answer the server sends, on any connection, never reaches the client: its
  connection ends instead (the request was carried out; the client cannot know). Then ``pass``.

``fault(mode, seconds)`` switches to ``mode`` for a while, then back to ``pass``. ``answered`` counts
the bytes of the server's answers that reached clients.
"""

from __future__ import annotations

import contextlib
import re
import socket
import struct
import threading
import time

_STATUS = re.compile(rb"HTTP/1\.[01] (\d{3}) ")
_CHUNK = 16 << 10  # bytes passed at a time when throttled


class FaultProxy:
    def __init__(self, target_port: int, delay: float = 0.5, rate: float = 1 << 20) -> None:
        self.target = ("127.0.0.1", target_port)
        self.delay = delay
        self.rate = rate
        self._mode = "pass"
        self._until = 0.0
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.1)  # accept() wakes up to see close()
        self.port: int = self._listener.getsockname()[1]
        self.counts: dict[str, int] = {"pass": 0, "503": 0, "drop": 0, "delay": 0, "lose": 0, "throttle": 0}
        self.answered = 0
        self._counting = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def fault(self, mode: str, seconds: float = 1e9) -> None:
        self._mode, self._until = mode, time.monotonic() + seconds

    def mode(self) -> str:
        return self._mode if time.monotonic() < self._until else "pass"

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._listener.close()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            client.settimeout(None)
            mode = self.mode()
            if mode == "lose":
                mode = "pass"  # answers are lost as they come back, whichever connection carries them
            self.counts[mode] += 1
            threading.Thread(target=self._handle, args=(client, mode), daemon=True).start()

    def _handle(self, client: socket.socket, mode: str) -> None:
        with contextlib.closing(client):
            if mode == "drop":
                client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # RST
                return
            if mode == "503":
                with contextlib.suppress(OSError):
                    _read_request(client)
                body = b"<Error><Code>ServiceUnavailable</Code><Message>try again</Message></Error>"
                head = "HTTP/1.1 503 Service Unavailable\r\nConnection: close\r\n"
                head += f"Content-Length: {len(body)}\r\n\r\n"
                with contextlib.suppress(OSError):
                    client.sendall(head.encode() + body)
                return
            if mode == "delay":
                time.sleep(self.delay)
            try:
                upstream = socket.create_connection(self.target)
            except OSError:
                return
            rate = self.rate if mode == "throttle" else None
            with contextlib.closing(upstream):
                back = threading.Thread(target=self._answer, args=(upstream, client, rate), daemon=True)
                back.start()
                _pipe(client, upstream, rate)
                back.join(timeout=30)

    def _answer(self, upstream: socket.socket, client: socket.socket, rate: float | None) -> None:
        """The server's answers to the client, unless one is to be lost (``lose``)."""
        with contextlib.suppress(OSError):
            while chunk := upstream.recv(_CHUNK if rate else 1 << 16):
                if rate:
                    time.sleep(len(chunk) / rate)
                final = any(not code.startswith(b"1") for code in _STATUS.findall(chunk))  # not a 100
                if final and self.mode() == "lose":
                    self._mode = "pass"
                    self.counts["lose"] += 1
                    client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    client.shutdown(socket.SHUT_RDWR)  # the connection ends; the answer never arrives
                    return
                client.sendall(chunk)
                with self._counting:
                    self.answered += len(chunk)
        with contextlib.suppress(OSError):
            client.shutdown(socket.SHUT_WR)


def _read_request(sock: socket.socket) -> None:
    """Read one HTTP request (head and Content-Length body) so the client sees a whole answer. A
    client that sends ``Expect: 100-continue`` waits for the answer before its body: not read."""
    sock.settimeout(5)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            return
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    if b"100-continue" in head.lower():
        return
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":", 1)[1])
    while len(body) < length:
        chunk = sock.recv(65536)
        if not chunk:
            return
        body += chunk


def _pipe(src: socket.socket, dst: socket.socket, rate: float | None = None) -> None:
    with contextlib.suppress(OSError):
        while chunk := src.recv(_CHUNK if rate else 1 << 16):
            if rate:
                time.sleep(len(chunk) / rate)
            dst.sendall(chunk)
    with contextlib.suppress(OSError):
        dst.shutdown(socket.SHUT_WR)
