"""Run the chat service with uvicorn in a background thread (tests, examples, a trainer process).

``ServiceThread(app).start()`` binds ``host:port`` (port 0 = a free port chosen by the OS, read back from the bound
socket, so there is no pick-then-bind race) and returns once the server accepts connections.

Limits on connections (slow or many clients), all uvicorn's own except the header deadline, which uvicorn lacks:

* ``limit_concurrency``: connections + requests in progress beyond it are answered 503 at once;
* ``header_timeout_s``: a connection must complete its request headers within it, or it is closed (slowloris);
  the body then has ``ServiceConfig.body_timeout_s`` (408, enforced where the app reads it);
* ``timeout_keep_alive``: an idle keep-alive connection is closed after it;
* ``proxy_headers`` / ``forwarded_allow_ips``: behind a TLS-terminating reverse proxy, trust ``X-Forwarded-For`` /
  ``X-Forwarded-Proto`` from those addresses only (the client address then is the real one in the audit log).

``stop()`` is graceful: intake stops (503), requests inside the service finish, uvicorn closes connections and the
app's lifespan drains gradings and buffer writes. :meth:`ServiceThread.stop_on_signals` makes SIGTERM/SIGINT do
the same for a standalone service.
"""

from __future__ import annotations

import signal
import threading
import time


def _protocol_with_header_deadline(header_timeout_s: float):
    """uvicorn's h11 protocol, closing a connection whose request headers are not complete ``header_timeout_s``
    after its first byte (or after it opened)."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class HeaderDeadlineH11(H11Protocol):
        _deadline = None

        def _between_requests(self) -> bool:
            return self.cycle is None or self.cycle.response_complete

        def _arm(self) -> None:
            if self._deadline is None:
                self._deadline = self.loop.call_later(header_timeout_s, self._expire)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _expire(self) -> None:
            self._deadline = None
            if self._between_requests() and not self.transport.is_closing():
                self.transport.close()

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            if self._between_requests():
                self._arm()  # a new request's headers start (a keep-alive connection's idle time is uvicorn's)
            super().data_received(data)
            if not self._between_requests():
                self._disarm()

        def on_response_complete(self) -> None:
            self._disarm()
            super().on_response_complete()

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

    return HeaderDeadlineH11


class ServiceThread:
    """uvicorn serving ``app`` in a daemon thread; a context manager (``with ServiceThread(app) as s: s.url``).

    An app built by :func:`~claas_verl.claas.service.build_app` is checked against ``host`` first
    (:func:`~claas_verl.claas.service.config.check_exposure`: no keyless service off loopback, keyless only by opt-in).
    """

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning", *,
                 limit_concurrency: int = 512, header_timeout_s: float = 10.0, timeout_keep_alive: float = 5.0,
                 timeout_graceful_shutdown: float = 30.0, proxy_headers: bool = False,
                 forwarded_allow_ips: str | list[str] | None = None):
        import uvicorn

        from claas_verl.claas.service.config import check_exposure

        self.service = getattr(getattr(app, "state", None), "claas_service", None)
        if self.service is not None:
            check_exposure(host, self.service.config)
        if limit_concurrency < 1 or not header_timeout_s > 0:
            raise ValueError(f"limit_concurrency must be >= 1 and header_timeout_s > 0, got {limit_concurrency}, "
                             f"{header_timeout_s}")
        self._server = uvicorn.Server(uvicorn.Config(
            app, host=host, port=port, log_level=log_level, lifespan="on", access_log=False,
            http=_protocol_with_header_deadline(header_timeout_s), limit_concurrency=limit_concurrency,
            timeout_keep_alive=int(timeout_keep_alive), timeout_graceful_shutdown=int(timeout_graceful_shutdown),
            proxy_headers=proxy_headers, forwarded_allow_ips=forwarded_allow_ips if proxy_headers else None))
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
        """Graceful: stop intake (503), let requests inside the service finish (up to ``timeout_s``), then stop
        uvicorn (its lifespan drains gradings and buffer writes)."""
        if self.service is not None and self._thread.is_alive():
            self.service.stop_intake()
            self.service.wait_idle(timeout_s)
        self._server.should_exit = True
        self._thread.join(timeout_s)

    def stop_on_signals(self, signals=(signal.SIGTERM, signal.SIGINT)) -> threading.Event:
        """From the main thread: make ``signals`` stop the service gracefully (in a helper thread, so the handler
        returns at once); returns an event set once it stopped (``ServiceThread(...).stop_on_signals().wait()``)."""
        stopped = threading.Event()

        def handler(signum, frame) -> None:
            threading.Thread(target=lambda: (self.stop(), stopped.set()), name="claas-service-stop",
                             daemon=True).start()

        for sig in signals:
            signal.signal(sig, handler)
        return stopped

    def __enter__(self) -> ServiceThread:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
