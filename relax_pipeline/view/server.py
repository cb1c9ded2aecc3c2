"""Serving the viewer: `serve_view` (blocking, for `job=view` and the command line) and `ViewServer` (a
background thread, for tests and notebooks).

Both bind the socket first, so port 0 picks a free port and `url` is known before the first request. The
blocking form logs one line with the URL and serves until interrupted (Ctrl-C ends it cleanly). Nothing
here reads the run folder; that is `view/app.py`.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from pathlib import Path

import uvicorn

from relax_pipeline.view.app import create_app

log = logging.getLogger(__name__)


def bound_socket(host: str, port: int) -> socket.socket:
    """A socket already listening on `host:port`: a client that reads the printed URL and connects before uvicorn's
    loop runs waits in the backlog instead of being refused."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    return sock


class ViewServer:
    """The viewer of one run folder on `host:port` in a daemon thread; `start()` returns once it accepts."""

    def __init__(self, root: Path, host: str = "127.0.0.1", port: int = 0, tokenizer: str | None = None) -> None:
        self.app = create_app(Path(root), tokenizer)
        self.sock = bound_socket(host, port)
        self.host, self.port = host, self.sock.getsockname()[1]
        self._server = uvicorn.Server(uvicorn.Config(self.app, log_level="warning", access_log=False))
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/"

    def start(self, timeout: float = 30.0) -> ViewServer:
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the viewer did not start on {self.url}")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)


def serve_view(root: str | Path | None, host: str = "127.0.0.1", port: int = 8765,
               tokenizer: str | None = None) -> dict[str, float]:
    """Serve the viewer of `root` until interrupted; `job=view` returns its (empty) metrics."""
    if not root:
        raise ValueError("job=view needs the run folder: view.dir=PATH (or output_dir=PATH)")
    app = create_app(Path(str(root)), tokenizer)
    sock = bound_socket(host, port)
    url = f"http://{host}:{sock.getsockname()[1]}/"
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    log.info("run viewer of %s at %s (Ctrl-C stops it)", Path(str(root)).resolve(), url)
    uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False)).run(sockets=[sock])
    return {}
