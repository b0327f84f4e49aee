"""A tiny OpenAI-compatible server that misbehaves on purpose (500s, garbage, slowness, dying, refusals).

Its answer to a conversation is a function of the conversation ("echo: <last user text>"), so a
test can say what every regenerated row must hold without asking it.
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

MODEL = "fake-model"
ECHO = object()  # completion()'s default content: the answer to the history (None sends a null content)


def answer(messages: list[dict[str, Any]]) -> str:
    """What the fake server answers to this history."""
    last = [m for m in messages if m["role"] in ("user", "tool")][-1]
    return f"echo: {str(last.get('content'))[:40]}"


class Fake:
    """``behave(n, body) -> (status, payload bytes) | None`` decides each chat request (n counts from 1)."""

    def __init__(self, behave: Any = None):
        self.behave = behave
        self.requests: list[dict[str, Any]] = []
        self.lock = threading.Lock()
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a: Any) -> None:
                pass

            def _send(self, status: int, payload: bytes) -> None:
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def do_GET(self) -> None:
                if self.path.endswith("/models"):
                    self._send(200, json.dumps({"object": "list", "data": [
                        {"id": MODEL, "object": "model", "owned_by": "fake"}]}).encode())
                else:
                    self._send(404, b'{"detail": "Not Found"}')

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["content-length"])))
                with fake.lock:
                    fake.requests.append(body)
                    n = len(fake.requests)
                out = fake.behave(n, body) if fake.behave else None
                if out == "close":
                    self.close_connection = True
                    self.connection.close()
                    return
                if out is not None:
                    self._send(*out)
                    return
                self._send(200, completion(body))

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> Fake:
        self.thread.start()
        return self

    def __exit__(self, *a: Any) -> None:
        self.server.shutdown()
        self.server.server_close()


def completion(body: dict[str, Any], finish: str = "stop", content: Any = ECHO, **message: Any) -> bytes:
    text = answer(body["messages"]) if content is ECHO else content
    return json.dumps({
        "id": "x", "object": "chat.completion", "created": int(time.time()), "model": MODEL,
        "choices": [{"index": 0, "finish_reason": finish,
                     "message": {"role": "assistant", "content": text, **message}}],
        "usage": {"prompt_tokens": 3, "completion_tokens": len(str(text or "").split()), "total_tokens": 3},
    }).encode()
