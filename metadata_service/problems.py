"""RFC 9457 problem+json for every error the service returns, with the stable codes of xinfra.errors.

Validation errors are ``invalid_request`` with status 422 (body, query, path
shape) or 400 (semantics checked by the services).  Unknown routes are
``not_found``; an unexpected exception is ``internal`` with status 500 and is
logged with its traceback (it is a bug, never an operating error).
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from xinfra.errors import XinfraError

log = logging.getLogger(__name__)

PROBLEM_MEDIA_TYPE = "application/problem+json"
TYPE_BASE = "https://xinfra.dev/problems/"

_HTTP_CODES = {
    400: "invalid_request",
    401: "unauthenticated",
    403: "forbidden",
    404: "not_found",
    405: "invalid_request",
    406: "invalid_request",
    409: "conflict",
    413: "invalid_request",
    415: "invalid_request",
    422: "invalid_request",
    429: "backpressure",
    503: "unavailable",
}


def problem(
    status: int,
    code: str,
    title: str,
    detail: str,
    instance: str | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    body: dict[str, Any] = {
        "type": TYPE_BASE + code,
        "title": title,
        "status": status,
        "detail": detail,
        "code": code,
    }
    if instance is not None:
        body["instance"] = instance
    return JSONResponse(body, status_code=status, media_type=PROBLEM_MEDIA_TYPE, headers=headers)


def _title(code: str) -> str:
    return code.replace("_", " ").capitalize()


def error_response(error: XinfraError, instance: str | None = None) -> JSONResponse:
    headers = {"Retry-After": "1"} if error.retriable else None
    if error.http_status == 401:
        headers = {"WWW-Authenticate": "Bearer"}
    return problem(
        error.http_status, error.code, _title(error.code), error.message, instance, headers
    )


def _describe_validation(error: RequestValidationError) -> str:
    parts = []
    for item in error.errors()[:10]:
        loc = tuple(item.get("loc", ()))
        # "body.shards" says where FastAPI looked; the caller named the field "shards"
        where = ".".join(str(p) for p in (loc[1:] if loc[:1] == ("body",) else loc)) or "body"
        parts.append(f"{where}: {item.get('msg', 'invalid')}")
    return "; ".join(parts) or "the request does not match the API schema"


def install_problem_handlers(app: FastAPI) -> None:
    @app.exception_handler(XinfraError)
    async def _xinfra_error(request: Request, error: XinfraError) -> JSONResponse:
        return error_response(error, request.url.path)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, error: RequestValidationError) -> JSONResponse:
        return problem(
            422,
            "invalid_request",
            "Invalid request",
            _describe_validation(error),
            request.url.path,
        )

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
        code = _HTTP_CODES.get(
            error.status_code, "internal" if error.status_code >= 500 else "invalid_request"
        )
        return problem(
            error.status_code,
            code,
            _title(code),
            str(error.detail),
            request.url.path,
            dict(error.headers) if error.headers else None,
        )

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, error: Exception) -> JSONResponse:
        log.exception("unexpected error serving %s %s", request.method, request.url.path)
        return problem(
            500,
            "internal",
            "Internal error",
            f"unexpected {type(error).__name__}; see the service log",
            request.url.path,
        )


_PROBLEM_CONTENT = {PROBLEM_MEDIA_TYPE: {"schema": {"$ref": "#/components/schemas/Problem"}}}


def problem_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI ``responses`` entries for the given error statuses (problem+json bodies)."""
    descriptions = {
        400: "Invalid request",
        401: "Missing or unknown bearer token",
        403: "The token's role or scope does not allow this",
        404: "Not found",
        409: "Conflict (version_conflict, topic_already_exists, sealed, ...)",
        413: "Request body too large",
        422: "Request does not match the schema",
        429: "A bounded resource is full; retry with backoff",
        503: "A dependency (database, backend, ZooKeeper) is unavailable",
        504: "A dependency timed out",
    }
    return {
        status: {"description": descriptions[status], "content": _PROBLEM_CONTENT}
        for status in statuses
    }
