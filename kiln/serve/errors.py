"""The errors the server answers with: one class, a kind that fixes the HTTP status and the
gRPC code, and a message that names the thing at fault."""

from __future__ import annotations

import enum

import grpc


class Kind(enum.Enum):
    #            HTTP status, gRPC code,                       failure reason (metrics)
    INVALID = (400, grpc.StatusCode.INVALID_ARGUMENT, "OTHER")
    NOT_FOUND = (404, grpc.StatusCode.NOT_FOUND, "OTHER")
    TOO_LARGE = (413, grpc.StatusCode.RESOURCE_EXHAUSTED, "OTHER")
    UNAVAILABLE = (503, grpc.StatusCode.UNAVAILABLE, "REJECTED")
    TIMEOUT = (504, grpc.StatusCode.DEADLINE_EXCEEDED, "REJECTED")
    INTERNAL = (500, grpc.StatusCode.INTERNAL, "BACKEND")

    @property
    def http_status(self) -> int:
        return self.value[0]

    @property
    def grpc_code(self) -> grpc.StatusCode:
        return self.value[1]

    @property
    def reason(self) -> str:
        return self.value[2]


class ServeError(Exception):
    """An error answered to a client: ``{"error": message}`` with ``kind.http_status`` over
    HTTP, ``kind.grpc_code`` over gRPC."""

    def __init__(self, kind: Kind, message: str):
        super().__init__(message)
        self.kind = kind
        self.message = message


def invalid(msg: str) -> ServeError:
    return ServeError(Kind.INVALID, msg)


def not_found(msg: str) -> ServeError:
    return ServeError(Kind.NOT_FOUND, msg)


def unavailable(msg: str) -> ServeError:
    return ServeError(Kind.UNAVAILABLE, msg)
