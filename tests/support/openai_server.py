"""A scripted OpenAI-style server on 127.0.0.1 for the http backend's protocol tests: it answers
each POST from a script of (status, body, headers), or forwards it to a real server (`upstream`,
a `vllm serve` in the end-to-end tests) once the script is used up, recording every request.
A fault proxy, not a model: what the answers mean is the real server's."""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request
from collections import deque
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

Answer = tuple[int, Any, dict[str, str]]  # status, JSON body (or text), headers


class ScriptedServer:
    """`url`: its base URL. `script`: answers to POSTs given in order (then `upstream`, else 200
    with `default`); `get_script` the same for GETs (then `upstream`, else the model list
    `models`: GET /v1/models). `requests`: each request's (path, JSON body; None for a GET), in
    arrival order; `headers` theirs."""

    def __init__(
        self,
        script: list[Answer] | None = None,
        upstream: str | None = None,
        default: Any = None,
        get_script: list[Answer] | None = None,
        models: tuple[str, ...] = ("tiny",),
    ):
        self.script: deque[Answer] = deque(script or [])
        self.get_script: deque[Answer] = deque(get_script or [])
        self.models = {"object": "list", "data": [{"id": m} for m in models]}
        self.upstream, self.default = upstream, default
        self.requests: list[tuple[str, Any]] = []
        self.headers: list[dict[str, str]] = []
        self.lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"null")
                script = server.get_script if self.command == "GET" else server.script
                with server.lock:
                    server.requests.append((self.path, body))
                    server.headers.append(dict(self.headers))
                    answer = script.popleft() if script else None
                if answer is None and server.upstream is not None:
                    answer = server.forward(self.path, body)
                fallback = server.models if self.command == "GET" else server.default
                status, payload, headers = answer or (200, fallback, {})
                data = payload.encode() if isinstance(payload, str) else json.dumps(payload).encode()
                self.send_response(status)
                for k, v in {"Content-Type": "application/json", **headers}.items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST  # a GET's body is None (GET /v1/models)

            def log_message(self, *args: Any) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def forward(self, path: str, body: Any) -> Answer:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(
            f"{self.upstream}{path}", data=data, headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(request, timeout=120) as r:
                return r.status, json.loads(r.read()), {}
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode(), {}

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def __enter__(self) -> ScriptedServer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
