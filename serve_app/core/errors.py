"""Errors that carry their own HTTP meaning.

Model code and deployments raise these; the router (the single error boundary) turns
them into OpenAI-style error bodies. They must survive a trip through Ray's pickling,
so every field is a constructor argument (see ``__reduce__``).
"""

from __future__ import annotations


class ServeAppError(Exception):
    """Base class: an error whose status and OpenAI error type are known."""

    status_code = 500
    error_type = "server_error"

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code

    def __reduce__(self):
        return (_rebuild, (type(self), self.message, self.param, self.code))

    def headers(self) -> dict[str, str]:
        """Extra response headers this error calls for."""
        return {}

    def to_body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.error_type,
                "param": self.param,
                "code": self.code,
            }
        }


def _rebuild(cls, message, param, code):
    return cls(message, param=param, code=code)


class InvalidRequestError(ServeAppError):
    """The client sent something we cannot serve (HTTP 400)."""

    status_code = 400
    error_type = "invalid_request_error"


class ContextLengthExceededError(InvalidRequestError):
    """An input is longer than the model accepts; the message names both numbers."""

    def __init__(self, message: str, *, param: str | None = None, code: str | None = "context_length_exceeded"):
        super().__init__(message, param=param, code=code)


class ModelNotFoundError(ServeAppError):
    """The request names a model this service does not serve (HTTP 404)."""

    status_code = 404
    error_type = "invalid_request_error"

    def __init__(self, message: str, *, param: str | None = "model", code: str | None = "model_not_found"):
        super().__init__(message, param=param, code=code)


class OverloadedError(ServeAppError):
    """Queues are full; the client should retry later (HTTP 503 with Retry-After)."""

    status_code = 503
    error_type = "overloaded_error"

    def __init__(self, message: str, *, retry_after_s: int = 1, param: str | None = None, code: str | None = "overloaded"):
        super().__init__(message, param=param, code=code)
        self.retry_after_s = retry_after_s

    def __reduce__(self):
        return (_rebuild_overloaded, (self.message, self.retry_after_s, self.code))

    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(self.retry_after_s)}


def _rebuild_overloaded(message, retry_after_s, code):
    return OverloadedError(message, retry_after_s=retry_after_s, code=code)


class ModelUnavailableError(ServeAppError):
    """The model's deployment has no replica that can serve, for example because its
    model failed to load (HTTP 503). Other models keep serving."""

    status_code = 503
    error_type = "server_error"

    def __init__(self, message: str, *, param: str | None = "model", code: str | None = "model_unavailable"):
        super().__init__(message, param=param, code=code)


class EngineRestartingError(ModelUnavailableError):
    """The engine of the replica that took the call died (vLLM's engine core); Serve
    replaces that replica. The call may run on another one: the router retries it,
    and a client that still gets this 503 may retry after a few seconds."""

    retry_after_s = 5

    def __init__(self, message: str, *, param: str | None = None, code: str | None = "engine_dead"):
        super().__init__(message, param=param, code=code)

    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(self.retry_after_s)}


class DeadlineExceededError(ServeAppError):
    """The request waited or ran past its deadline (HTTP 504)."""

    status_code = 504
    error_type = "timeout_error"


class AuthenticationError(ServeAppError):
    """No API key, or one this service does not know (HTTP 401)."""

    status_code = 401
    error_type = "invalid_request_error"

    def __init__(self, message: str, *, param: str | None = None, code: str | None = "invalid_api_key"):
        super().__init__(message, param=param, code=code)


class PermissionDeniedError(ServeAppError):
    """A valid key without the rights for this endpoint (HTTP 403)."""

    status_code = 403
    error_type = "permission_error"

    def __init__(self, message: str, *, param: str | None = None, code: str | None = "admin_key_required"):
        super().__init__(message, param=param, code=code)


class PayloadTooLargeError(ServeAppError):
    """The request body is over the configured size limit (HTTP 413)."""

    status_code = 413
    error_type = "invalid_request_error"

    def __init__(self, message: str, *, param: str | None = None, code: str | None = "request_too_large"):
        super().__init__(message, param=param, code=code)


class HTTPStatusError(ServeAppError):
    """A client error the web framework decided (unknown path, wrong method), carried in
    the same OpenAI error shape as ours."""

    error_type = "invalid_request_error"

    def __init__(self, status_code: int, message: str, *, code: str | None = None):
        super().__init__(message, code=code)
        self.status_code = status_code

    def __reduce__(self):
        return (HTTPStatusError, (self.status_code, self.message), {"code": self.code, "param": self.param})
