"""A loopback HTTP proxy in front of the moto server that fails chosen requests.

Each request is read in full, then its fate is decided: forwarded, answered with an S3-style 500
(``InternalError``) or 503 (``SlowDown``) or 403 (``AccessDenied``), or its connection is reset
(RST, no reply) before or after forwarding it (in the latter case the request took effect and only
the reply is lost). Fates come from a seeded random draw (``rate``) or from ``rule(method, path)``.
Loopback only; one thread per connection; stopped by :meth:`FaultProxy.close`.
"""

from __future__ import annotations

import http.client
import random
import socket
import struct
import threading
from collections.abc import Callable, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

Fate = str | int | None  # None: forward; 500/503/403: error reply; "reset" / "reset-after"

_ERRORS = {
    500: ("InternalError", "We encountered an internal error. Please try again."),
    503: ("SlowDown", "Please reduce your request rate."),
    403: ("AccessDenied", "Access Denied"),
}
_HOP = {"connection", "keep-alive", "transfer-encoding", "expect", "proxy-connection", "te", "upgrade"}


class FaultProxy:
    def __init__(self, upstream: str, *, rate: float = 0.0, seed: int = 0,
                 fates: Sequence[Fate] = (500, 503, "reset", "reset-after"),
                 rule: Callable[[str, str], Fate] | None = None):
        u = urlsplit(upstream)
        self.upstream = (u.hostname or "127.0.0.1", int(u.port or 80))
        self.rate = rate
        self.fates = list(fates)
        self.rule = rule
        self.rng = random.Random(seed)
        self.lock = threading.Lock()
        self.log: list[tuple[str, str, Fate]] = []
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
        self.server.daemon_threads = True
        self.server.proxy = self  # type: ignore[attr-defined]
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05},
                                       daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_port}"

    def decide(self, method: str, path: str) -> Fate:
        with self.lock:
            fate: Fate = None
            if self.rule is not None:
                fate = self.rule(method, path)
            elif self.rate and self.rng.random() < self.rate:
                fate = self.rng.choice(self.fates)
            self.log.append((method, path, fate))
            return fate

    def failures(self) -> int:
        with self.lock:
            return sum(f is not None for _, _, f in self.log)

    def forward(self, method: str, path: str, headers: list[tuple[str, str]], body: bytes
                ) -> tuple[int, list[tuple[str, str]], bytes]:
        conn = http.client.HTTPConnection(*self.upstream, timeout=30)
        try:
            conn.putrequest(method, path, skip_host=True, skip_accept_encoding=True)
            for k, v in headers:
                if k.lower() not in _HOP and k.lower() != "content-length":
                    conn.putheader(k, v)
            if body or method in ("PUT", "POST"):
                conn.putheader("Content-Length", str(len(body)))
            conn.endheaders(body or None)
            resp = conn.getresponse()
            data = resp.read() if method != "HEAD" else b""
            return resp.status, resp.getheaders(), data
        finally:
            conn.close()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: ThreadingHTTPServer

    def setup(self) -> None:
        super().setup()
        # replies go out as headers + body writes: without NODELAY, Nagle + delayed ACKs add ~40 ms
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - the base's name
        pass

    def _read_body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            chunks: list[bytes] = []
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass  # trailers
                    return b"".join(chunks)
                chunks.append(self.rfile.read(size))
                self.rfile.readline()
        n = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(n) if n else b""

    def _reset(self) -> None:
        # SO_LINGER 0 + close: the client sees ECONNRESET, not a reply.
        self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.close_connection = True
        self.connection.close()

    def _handle(self) -> None:
        proxy: FaultProxy = self.server.proxy  # type: ignore[attr-defined]
        body = self._read_body()
        fate = proxy.decide(self.command, self.path)
        if fate == "reset":
            self._reset()
            return
        if isinstance(fate, int):
            code, msg = _ERRORS[fate]
            xml = (f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code><Message>{msg}</Message>'
                   f"<RequestId>injected</RequestId></Error>").encode()
            self.send_response(fate)
            self.send_header("Content-Type", "application/xml")
            self.send_header("Content-Length", str(len(xml)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(xml)
            return
        status, headers, data = proxy.forward(self.command, self.path, list(self.headers.items()), body)
        if fate == "reset-after":
            self._reset()
            return
        self.send_response(status)
        length = None
        for k, v in headers:
            if k.lower() == "content-length":
                length = v
            elif k.lower() not in _HOP and k.lower() not in ("server", "date"):
                self.send_header(k, v)
        self.send_header("Content-Length", length if self.command == "HEAD" and length else str(len(data)))
        self.end_headers()
        if self.command != "HEAD" and data:
            self.wfile.write(data)

    do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle
