"""HTTP errors in the OpenAI error shape, and the mapping from the library's exceptions.

Body: ``{"error": {"message": ..., "type": ..., "param": ..., "code": ...}}``. The
message says what to fix; ``param`` names the request field at fault when there is one.
"""

from __future__ import annotations

import math
from typing import Any

from ..errors import InvalidArgument, MooncakeError, Overloaded, ServiceUnavailable, TransferFailed, TransferTimeout

__all__ = ["ApiError", "from_exception"]

# Overloaded reasons that mean "nothing can serve", not "too busy right now"
_NO_INSTANCE = ("no_prefill_instance", "no_decode_instance")


class ApiError(Exception):
    """An HTTP error response: ``status``, ``message``, OpenAI ``type`` / ``param`` / ``code``,
    extra response ``headers`` (``Retry-After`` on 429)."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


def unavailable(message: str) -> ApiError:
    return ApiError(503, message, type="service_unavailable", code="no_instance")


def _retry_after(e: Overloaded) -> str:
    # The conductor's wait of its rejection (the TTFT estimate's excess over the SLO, or
    # until a decode instance frees a place) follows the queue; an older conductor's
    # queue estimate otherwise; without either, a second.
    est = getattr(e.estimates, "retry_after_s", None)
    if not (isinstance(est, float) and math.isfinite(est) and est > 0):
        est = getattr(e.estimates, "est_queue_s", None)
    secs = est if isinstance(est, float) and math.isfinite(est) and est > 0 else 1.0
    return str(max(1, math.ceil(min(secs, 3600.0))))


def from_exception(e: BaseException) -> ApiError:
    """The response for an exception raised while preparing or running a request."""
    if isinstance(e, ApiError):
        return e
    if isinstance(e, Overloaded):
        if e.reason in _NO_INSTANCE:
            return unavailable(f"no instance can serve requests now ({e.reason}); retry once instances are up")
        return ApiError(429, f"the cluster is overloaded and rejected the request ({e.reason or 'slo'}): {e}; "
                             "retry after the time in Retry-After or lower the request rate",
                        type="rate_limit_error", code=e.reason or "overloaded",
                        headers={"Retry-After": _retry_after(e)})
    if isinstance(e, InvalidArgument):
        return bad_request(str(e))
    if isinstance(e, ServiceUnavailable):
        return ApiError(503, f"the service is unavailable: {e}; retry shortly", type="service_unavailable",
                        code="unavailable", headers={"Retry-After": "1"})
    if isinstance(e, TransferTimeout):
        return ApiError(504, f"the request timed out: {e}", type="timeout", code="timeout")
    if isinstance(e, TransferFailed):
        return ApiError(503, f"the request failed on an instance: {e}; retry it", type="service_unavailable",
                        code="instance_failed")
    if isinstance(e, MooncakeError):
        return ApiError(500, f"{type(e).__name__}: {e}", type="internal_error", code="internal_error")
    return ApiError(500, f"internal error ({type(e).__name__}); see the server log", type="internal_error",
                    code="internal_error")
