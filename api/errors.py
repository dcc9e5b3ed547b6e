"""Errors → HTTP: the project's error tree mapped onto OpenAI's error shape.

Every error the gateway answers with is ``{"error": {"message", "type",
"param", "code"}}`` with the status an OpenAI client expects: 400 for a
request it cannot serve, 401 without the right token, 404 for another
model, 409 when a control command finds no worker or is refused, 413 past
a size limit, 429 (or 503) when saturated, 503 without Redis, 504 on
timeout (vLLM's weight-transfer routes answer 400 or 409 only, mapped in
``api.vllm_server``: TRL retries 5xx mid-transfer);
499 (nginx's "client closed request") is only counted, its client is gone.
The error classes live in ``tasks.errors``; only the mapping is here.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError

from rollout_queue.api.schemas import ErrorDetail, ErrorResponse
from rollout_queue.tasks.errors import (
    BadRequest,
    BrokerUnavailable,
    ClientDisconnected,
    ControlError,
    ControlTimeout,
    GatewaySaturated,
    GenerationTimeout,
    InvalidRequest,
    ModelNotFound,
    PromptTooLong,
    RequestTooLarge,
    ResultTimeout,
    Unauthorized,
)

log = logging.getLogger("rollout_queue.api")

# Errors a worker raised about the request itself, known here by class name
# only (their modules, vLLM's, are not importable in the gateway).
_CLIENT_ERRORS = {"VLLMValidationError"}


def error_body(
    message: str, type_: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return ErrorResponse(error=ErrorDetail(message=message, type=type_, param=param, code=code)).model_dump()


def error_response(
    status: int,
    message: str,
    type_: str,
    param: str | None = None,
    code: str | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    return JSONResponse(error_body(message, type_, param, code), status_code=status, headers=headers)


def from_exception(exc: BaseException, saturated_status: int = 429) -> JSONResponse:
    """The response for an error raised while serving a request (or by its task)."""
    if isinstance(exc, BadRequest):
        return error_response(400, str(exc), "invalid_request_error", exc.param)
    if isinstance(exc, RequestTooLarge):
        return error_response(413, str(exc), "invalid_request_error", exc.param, "request_too_large")
    if isinstance(exc, ValidationError):  # a model built from request data refused it
        return from_validation(exc)
    if isinstance(exc, ClientDisconnected):  # nobody reads it; logged and counted as 499
        return error_response(499, str(exc), "client_closed_request")
    if isinstance(exc, (InvalidRequest, PromptTooLong)) or type(exc).__name__ in _CLIENT_ERRORS:
        return error_response(400, str(exc), "invalid_request_error")
    if isinstance(exc, Unauthorized):
        return error_response(
            401, str(exc), "authentication_error", code="invalid_api_key",
            headers={"WWW-Authenticate": "Bearer"},
        )
    if isinstance(exc, ModelNotFound):
        return error_response(404, str(exc), "not_found_error", "model", "model_not_found")
    if isinstance(exc, GatewaySaturated):
        type_ = "rate_limit_error" if saturated_status == 429 else "service_unavailable_error"
        return error_response(
            saturated_status, str(exc), type_, code="queue_full", headers={"Retry-After": "1"}
        )
    if isinstance(exc, (ResultTimeout, GenerationTimeout)):
        return error_response(504, str(exc), "timeout_error", code="timeout")
    if isinstance(exc, ControlTimeout):
        return error_response(504, str(exc), "timeout_error", code="control_timeout")
    if isinstance(exc, ControlError):  # no worker to ask, or one refused: not worth a retry
        return error_response(409, str(exc), "conflict_error", code="control_failed")
    if isinstance(exc, BrokerUnavailable):
        return error_response(503, str(exc), "service_unavailable_error", code="broker_unavailable")
    log.error("request failed: %s: %s", type(exc).__name__, exc)
    return error_response(500, f"{type(exc).__name__}: {exc}", "server_error")


_TYPE_TAGS = {"str", "int", "float", "bool", "dict", "list", "none", "json-or-python"}


def _field_path(loc: Any) -> str | None:
    """``("body", "prompt", "list[int]", 0)`` → ``"prompt.0"``: union branch tags dropped."""
    parts = [
        str(part)
        for part in loc
        if part != "body" and not (isinstance(part, str) and ("[" in part or part in _TYPE_TAGS))
    ]
    return ".".join(parts) or None


def from_validation(exc: RequestValidationError | ValidationError) -> JSONResponse:
    """Body validation → one short 400 naming the first field at fault (never a dump)."""
    errors = exc.errors()
    if not errors:
        return error_response(400, "invalid request", "invalid_request_error")
    first = errors[0]
    param = _field_path(first.get("loc", ()))
    message = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    if first.get("type") == "json_invalid":
        return error_response(400, f"the body is not valid JSON: {message}", "invalid_request_error")
    # Errors of one field's union branches are one mistake, not several.
    others = {_field_path(e.get("loc", ())) for e in errors[1:]} - {param}
    extra = f" (and errors in {len(others)} more fields)" if others else ""
    text = f"{param}: {message}{extra}" if param else f"{message}{extra}"
    return error_response(400, text[:1000], "invalid_request_error", param)
