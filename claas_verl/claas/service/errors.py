"""Errors of the chat service, each answered with its own HTTP status by :mod:`claas_verl.claas.service.http_app`."""


class AuthError(PermissionError):
    """A missing or wrong API key (HTTP 401) or a missing admin right (HTTP 403)."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


class LimitError(ValueError):
    """A request over a limit (413 for the body, 429 for a rate or a full queue with ``retry_after`` seconds, 400
    otherwise); the message names the limit."""

    def __init__(self, message: str, status: int = 400, retry_after: float | None = None):
        super().__init__(message)
        self.status = status
        self.retry_after = retry_after


class Unavailable(RuntimeError):
    """The service cannot take the request now (HTTP 503): draining for shutdown, or the replay buffer did not
    acknowledge the entry."""

    def __init__(self, message: str, retry_after: float | None = None):
        super().__init__(message)
        self.retry_after = retry_after

