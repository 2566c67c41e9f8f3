"""A real OpenAI-compatible chat-completions server on 127.0.0.1 for the judge's tests (the unit, CLI and Ray ones):
what a vLLM, SGLang or hosted server answers, well or badly, over real HTTP."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

#: a `raw` entry whose body is cut short: the Content-Length promises more than is sent (http.client.IncompleteRead)
CUT = "cut"


class JudgeServer:
    """Serves the models `served`, listed at /models unless `listed` is False (then /models answers 404, as a base
    URL without /v1 does); a request for another model answers 404, as vLLM does. A served model replies what
    `script` queues (a text, or (text, finish reason)), else `complete(body)`. Before that, each request takes the
    next of `raw` (status, JSON or bytes body; CUT: a cut body) and, while `fail` > 0, a 503 or 429 in turn (with
    `retry_after` as Retry-After). Every POST's time and body are recorded; with `key` set, a request without it gets
    401."""

    def __init__(
        self, served=("scripted",), complete: Callable[[dict], str] | None = None, key: str | None = None
    ) -> None:
        self.served, self.complete, self.key = list(served), complete, key
        self.reset()
        app = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _send(self, code: int, body, headers: dict | None = None) -> None:
                data = body if isinstance(body, bytes) else json.dumps(body).encode()
                self.send_response(code)
                for k, v in {"Content-Type": "application/json", **(headers or {})}.items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _cut(self) -> None:
                self.send_response(200)
                self.send_header("Content-Length", "1000")
                self.end_headers()
                self.wfile.write(b'{"choices": [')
                self.close_connection = True

            def _refused(self) -> bool:
                if app.key is not None and self.headers.get("Authorization") != f"Bearer {app.key}":
                    self._send(401, {"error": {"message": "bad key"}})
                    return True
                return False

            def do_GET(self):
                if self._refused():
                    return
                if not self.path.endswith("/v1/models") or not app.listed:
                    return self._send(404, {"error": {"message": "Not Found"}})
                self._send(200, {"object": "list", "data": [{"id": m} for m in app.served]})

            def do_POST(self):
                app.times.append(time.monotonic())
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                app.bodies.append(body)
                if self._refused():
                    return
                if app.raw:
                    got = app.raw.pop(0)
                    return self._cut() if got == CUT else self._send(*got)
                if app.fail > 0:
                    app.fail -= 1
                    after = {"Retry-After": app.retry_after} if app.retry_after else {}
                    return self._send(503 if app.fail % 2 else 429, {"error": {"message": "busy"}}, after)
                if not self.path.endswith("/v1/chat/completions") or body.get("model") not in app.served:
                    return self._send(404, {"error": {"message": f"The model `{body.get('model')}` does not exist."}})
                said = app.script.pop(0) if app.script else app.complete(body)
                text, finish = said if isinstance(said, tuple) else (said, "stop")
                message = {"role": "assistant", "content": text}
                choice = {"index": 0, "message": message, "finish_reason": finish}
                self._send(200, {"object": "chat.completion", "model": body["model"], "choices": [choice]})

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def reset(self) -> None:
        self.script, self.raw, self.times, self.bodies = [], [], [], []
        self.fail, self.retry_after, self.listed = 0, None, True

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
