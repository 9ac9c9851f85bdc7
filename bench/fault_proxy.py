"""S3 on 127.0.0.1 for the tests and fault_bench: moto's server, and a fault-injecting proxy.

It forwards every request to a real S3 server (moto's, in tests) and answers a share of them
with 503 SlowDown, the throttling answer S3 itself gives, delays others, or refuses every PUT
after the first few (a store that goes down mid-job). Only the answers change: the storage
behind it is real.
"""

from __future__ import annotations

import http.client
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlparse

SLOW_DOWN = (
    b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>SlowDown</Code>'
    b"<Message>Please reduce your request rate.</Message></Error>"
)


class FaultProxy:
    """Forwards to `upstream`; request n (counted from 1) gets a 503 when n % fail_every == 0,
    sleeps delay_s first when n % delay_every == 0, and every PUT after `puts_ok` PUTs fails."""

    def __init__(
        self, upstream: str, fail_every: int = 0, delay_every: int = 0, delay_s: float = 0.2, puts_ok: int | None = None
    ):
        self.upstream = urlparse(upstream)
        self.fail_every, self.delay_every, self.delay_s, self.puts_ok = fail_every, delay_every, delay_s, puts_ok
        self.lock = threading.Lock()
        self.requests = self.failed = self.delayed = self.puts = 0
        self.in_flight = self.max_in_flight = 0  # requests being answered at once (the most seen)
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):  # quiet
                pass

            def _any(self):
                proxy.handle(self)

            do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _any

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"

    def _decide(self, method: str) -> tuple[bool, bool]:
        with self.lock:
            self.requests += 1
            n = self.requests
            if method == "PUT":
                self.puts += 1
            fail = bool(self.fail_every and n % self.fail_every == 0)
            fail |= method == "PUT" and self.puts_ok is not None and self.puts > self.puts_ok
            delay = bool(self.delay_every and n % self.delay_every == 0)
            self.failed += fail
            self.delayed += delay and not fail
            return fail, delay

    def handle(self, req: BaseHTTPRequestHandler) -> None:
        with self.lock:
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            self._answer(req)
        finally:
            with self.lock:
                self.in_flight -= 1

    def _answer(self, req: BaseHTTPRequestHandler) -> None:
        body = req.rfile.read(int(req.headers.get("Content-Length") or 0))
        fail, delay = self._decide(req.command)
        if fail:
            req.send_response(503)
            req.send_header("Content-Type", "application/xml")
            req.send_header("Content-Length", str(len(SLOW_DOWN)))
            req.end_headers()
            if req.command != "HEAD":
                req.wfile.write(SLOW_DOWN)
            return
        if delay:
            time.sleep(self.delay_s)
        host = self.upstream.hostname
        assert host is not None, "the upstream URL names a host"
        conn = http.client.HTTPConnection(host, self.upstream.port, timeout=30)
        conn.request(req.command, req.path, body=body, headers=dict(req.headers))
        resp = conn.getresponse()
        data = resp.read()
        req.send_response(resp.status)
        for k, v in resp.getheaders():
            # A HEAD answer keeps the object's Content-Length (it has no body of its own).
            if k.lower() not in ("transfer-encoding", "connection") and (
                k.lower() != "content-length" or req.command == "HEAD"
            ):
                req.send_header(k, v)
        if req.command != "HEAD":
            req.send_header("Content-Length", str(len(data)))
        req.end_headers()
        if req.command != "HEAD":
            req.wfile.write(data)
        conn.close()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_moto_server(timeout_s: float = 30) -> tuple[subprocess.Popen, str]:
    """moto's S3 server (from this environment) on a free loopback port, once it accepts
    connections; returns the process and its endpoint URL."""
    port = free_port()
    proc = subprocess.Popen(
        [str(Path(sys.executable).parent / "moto_server"), "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return proc, f"http://127.0.0.1:{port}"
        except OSError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"moto_server did not start within {timeout_s:.0f} s")
