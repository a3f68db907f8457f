"""Fixtures of the data tests: a loopback HTTP server with Range support and fault modes."""

from __future__ import annotations

import hashlib
import re
import sys
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # `import native_formats` under any import mode

from fedshard_lightning.data import download
from fedshard_lightning.data.download import RemoteFile


@dataclass
class Request:
    path: str
    range: str | None


@dataclass
class ServerState:
    files: dict[str, bytes] = field(default_factory=dict)
    requests: list[Request] = field(default_factory=list)
    #: path -> number of upcoming requests that send only half the body, then drop the connection
    cut: dict[str, int] = field(default_factory=dict)
    #: answer every request with the whole file (status 200), as servers without Range support do
    ignore_range: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    state: ServerState

    def log_message(self, format, *args):  # keep test output clean
        pass

    def do_GET(self):
        state = self.server.state  # type: ignore[attr-defined]
        with state.lock:
            state.requests.append(Request(self.path, self.headers.get("Range")))
            data = state.files.get(self.path)
            cut = state.cut.get(self.path, 0) > 0
            if cut:
                state.cut[self.path] -= 1
        if data is None:
            self.send_response(404)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        start, status = 0, 200
        match = re.fullmatch(r"bytes=(\d+)-", self.headers.get("Range") or "")
        if match and not state.ignore_range:
            start = int(match.group(1))
            if start >= len(data):
                self.send_response(416)
                self.send_header("Content-Range", f"bytes */{len(data)}")
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            status = 206
        body = data[start:]
        self.send_response(status)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("Content-Length", str(len(body)))
        if status == 206:
            self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        self.end_headers()
        if cut:
            self.wfile.write(body[: len(body) // 2])
            self.wfile.flush()
            self.close_connection = True
            return
        self.wfile.write(body)


class LoopbackServer:
    """A ThreadingHTTPServer on 127.0.0.1 (port 0) serving ``state.files`` by path."""

    def __init__(self) -> None:
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
        self.httpd.daemon_threads = True
        self.state = ServerState()
        self.httpd.state = self.state  # type: ignore[attr-defined]
        self.thread = threading.Thread(
            target=self.httpd.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True
        )
        self.thread.start()

    @property
    def base(self) -> str:
        host, port = self.httpd.server_address[:2]
        return f"http://{host}:{port}"

    def serve(self, path: str, data: bytes) -> str:
        """Serve ``data`` at ``path``; returns its URL."""
        self.state.files[path] = data
        return self.base + path

    def url(self, path: str) -> str:
        return self.base + path

    @property
    def requests(self) -> list[Request]:
        return self.state.requests

    def remote(self, name: str, data: bytes, *, md5: bool = True, sha256: bool = False, size: bool = True):
        """Serve ``data`` as ``/files/<name>`` and describe it as a RemoteFile with its checksums."""
        url = self.serve(f"/files/{name}", data)
        return RemoteFile(
            name,
            (url,),
            md5=hashlib.md5(data).hexdigest() if md5 else None,
            sha256=hashlib.sha256(data).hexdigest() if sha256 else None,
            size=len(data) if size else None,
        )

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def server():
    srv = LoopbackServer()
    yield srv
    srv.close()


@pytest.fixture(autouse=True)
def _no_retry_backoff(monkeypatch):
    monkeypatch.setattr(download, "RETRY_BACKOFF_S", 0.0)
