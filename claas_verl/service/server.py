"""Run the chat service with uvicorn in a background thread (tests, examples, a trainer process).

``ServiceThread(app).start()`` binds ``host:port`` (port 0 = a free port chosen by the OS, read back from the bound
socket, so there is no pick-then-bind race) and returns once the server accepts connections.
"""

from __future__ import annotations

import threading
import time


class ServiceThread:
    """uvicorn serving ``app`` in a daemon thread; a context manager (``with ServiceThread(app) as s: s.url``)."""

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning"):
        import uvicorn

        self._server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=log_level,
                                                     lifespan="on", access_log=False))
        self.host = host
        self.port: int | None = None
        self._thread = threading.Thread(target=self._server.run, name="claas-chat-service", daemon=True)

    @property
    def url(self) -> str:
        if self.port is None:
            raise RuntimeError("the service is not started; call start() first")
        return f"http://{self.host}:{self.port}"

    @property
    def alive(self) -> bool:
        """True while the server thread runs (False after a crash or ``stop``)."""
        return self._thread.is_alive()

    def start(self, timeout_s: float = 60.0) -> ServiceThread:
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if not self._thread.is_alive():
                raise RuntimeError("the chat service thread exited during startup (see the log above)")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the chat service did not start within {timeout_s}s")
            time.sleep(0.02)
        self.port = self._server.servers[0].sockets[0].getsockname()[1]
        return self

    def stop(self, timeout_s: float = 30.0) -> None:
        self._server.should_exit = True
        self._thread.join(timeout_s)

    def __enter__(self) -> ServiceThread:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
