"""Errors raised by the opendsec SDK: one class per stable reason (docs/errors.md).

Every error opendsec returns carries a reason in a ``google.rpc.ErrorInfo`` detail (domain
``opendsec``) next to the gRPC code. :func:`from_rpc_error` reads it back and raises the class
of that reason; a status without ``ErrorInfo`` (a transport error, a proxy) is read by its code
alone, exactly as the Rust ``Reason::from_code`` does. Decide on the class (or ``.reason``),
never on the message. The list of reasons is kept equal to the Rust catalogue by a test.
"""

from __future__ import annotations

from typing import Dict, Mapping, Optional, Sequence, Tuple, Type

import grpc

DOMAIN = "opendsec"
_DETAILS_KEY = "grpc-status-details-bin"


class OpendsecError(Exception):
    """Base of every error the SDK raises for a failed call.

    Attributes:
        reason: the stable reason string, e.g. ``"not_found"``.
        message: the server's message, for people (may change; do not parse it).
        metadata: the ``ErrorInfo`` metadata (e.g. ``retry_after_ms`` for ``rate_limited``).
        code: the gRPC status code of the call, when it came from a call (else the class's
            ``grpc_code``).
        retryable: whether some class of call retries this reason (``rate_limited``,
            ``no_capacity``, ``not_leader``, ``unavailable``, ``deadline_exceeded``); which
            calls retry which reasons is the policy of ``docs/errors.md`` ("Retries"),
            :data:`opendsec._net.CLASS_RETRIES`.
        has_error_info: whether the reason came from an opendsec ``ErrorInfo`` (False: read
            from the bare gRPC code, e.g. a transport failure).
    """

    reason: str = ""
    #: Whether the reason came from an opendsec ErrorInfo (False: read from the bare code).
    has_error_info: bool = False
    grpc_code: grpc.StatusCode = grpc.StatusCode.UNKNOWN
    retryable: bool = False

    def __init__(
        self,
        message: str = "",
        metadata: Optional[Mapping[str, str]] = None,
        code: Optional[grpc.StatusCode] = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.metadata: Dict[str, str] = dict(metadata or {})
        self.code = code if code is not None else self.grpc_code

    def __str__(self) -> str:
        return f"{self.reason}: {self.message}"

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.message!r}, metadata={self.metadata!r})"




# Catalogue order (docs/errors.md, crates/common/src/reason.rs). Only ever added to.
class InvalidArgument(OpendsecError):
    """The request is malformed: a bad id, an empty or oversized field, an unknown backend..."""

    reason = "invalid_argument"
    grpc_code = grpc.StatusCode.INVALID_ARGUMENT


class Unauthenticated(OpendsecError):
    """No token, or a malformed, unknown, expired or revoked one."""

    reason = "unauthenticated"
    grpc_code = grpc.StatusCode.UNAUTHENTICATED


class PermissionDenied(OpendsecError):
    """The caller lacks the permission on the project (or cannot see it)."""

    reason = "permission_denied"
    grpc_code = grpc.StatusCode.PERMISSION_DENIED


class NotFound(OpendsecError):
    """The sandbox, project, principal, token, image or edge named does not exist."""

    reason = "not_found"
    grpc_code = grpc.StatusCode.NOT_FOUND


class AlreadyExists(OpendsecError):
    """A project, principal or image of that name exists."""

    reason = "already_exists"
    grpc_code = grpc.StatusCode.ALREADY_EXISTS


class InvalidState(OpendsecError):
    """The sandbox (or project) is in a state that does not allow the call."""

    reason = "invalid_state"
    grpc_code = grpc.StatusCode.FAILED_PRECONDITION


class QuotaExceeded(OpendsecError):
    """The project or one of its ancestors would go over its quota."""

    reason = "quota_exceeded"
    grpc_code = grpc.StatusCode.RESOURCE_EXHAUSTED


class RateLimited(OpendsecError):
    """Creation rate over the limit; retry after ``metadata['retry_after_ms']``."""

    reason = "rate_limited"
    grpc_code = grpc.StatusCode.RESOURCE_EXHAUSTED
    retryable = True

    @property
    def retry_after_s(self) -> Optional[float]:
        """The server's hint, in seconds, when it gave one."""
        try:
            return int(self.metadata["retry_after_ms"]) / 1000.0
        except (KeyError, ValueError):
            return None


class NoCapacity(OpendsecError):
    """Every edge that could run the sandbox is full or under pressure; retry with backoff."""

    reason = "no_capacity"
    grpc_code = grpc.StatusCode.RESOURCE_EXHAUSTED
    retryable = True


class NotLeader(OpendsecError):
    """A replicated IAM follower cannot serve the write."""

    reason = "not_leader"
    grpc_code = grpc.StatusCode.UNAVAILABLE
    retryable = True


class Unavailable(OpendsecError):
    """A component or node cannot serve now (or the connection failed)."""

    reason = "unavailable"
    grpc_code = grpc.StatusCode.UNAVAILABLE
    retryable = True


class DeadlineExceeded(OpendsecError):
    """The call ran out of time; it may still have taken effect."""

    reason = "deadline_exceeded"
    grpc_code = grpc.StatusCode.DEADLINE_EXCEEDED
    retryable = True  # by creations (their lease id finds what the first attempt made)


class Internal(OpendsecError):
    """A bug: a broken invariant on the server; report it."""

    reason = "internal"
    grpc_code = grpc.StatusCode.INTERNAL


#: Every reason class, in catalogue order.
ALL: Tuple[Type[OpendsecError], ...] = (
    InvalidArgument,
    Unauthenticated,
    PermissionDenied,
    NotFound,
    AlreadyExists,
    InvalidState,
    QuotaExceeded,
    RateLimited,
    NoCapacity,
    NotLeader,
    Unavailable,
    DeadlineExceeded,
    Internal,
)

#: reason string -> class.
BY_REASON: Dict[str, Type[OpendsecError]] = {c.reason: c for c in ALL}

# Reason a bare gRPC code implies (Rust `Reason::from_code`).
_FROM_CODE: Dict[grpc.StatusCode, Type[OpendsecError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgument,
    grpc.StatusCode.OUT_OF_RANGE: InvalidArgument,
    grpc.StatusCode.UNAUTHENTICATED: Unauthenticated,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDenied,
    grpc.StatusCode.NOT_FOUND: NotFound,
    grpc.StatusCode.ALREADY_EXISTS: AlreadyExists,
    grpc.StatusCode.FAILED_PRECONDITION: InvalidState,
    grpc.StatusCode.ABORTED: InvalidState,
    grpc.StatusCode.RESOURCE_EXHAUSTED: RateLimited,
    grpc.StatusCode.UNAVAILABLE: Unavailable,
    grpc.StatusCode.CANCELLED: Unavailable,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceeded,
}


def class_for_code(code: Optional[grpc.StatusCode]) -> Type[OpendsecError]:
    """The class a status without ErrorInfo maps to (anything unknown is ``Internal``)."""
    return _FROM_CODE.get(code, Internal) if code is not None else Internal


def parse_error_info(details_bin: bytes) -> Optional[Tuple[str, Dict[str, str]]]:
    """Reads ``(reason, metadata)`` from a serialized ``google.rpc.Status`` when it holds an
    opendsec ``ErrorInfo`` with a known reason; ``None`` otherwise."""
    from google.rpc import error_details_pb2, status_pb2

    try:
        status = status_pb2.Status.FromString(details_bin)
    except Exception:  # not a Status: read by code alone
        return None
    for any_ in status.details:
        if any_.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            info = error_details_pb2.ErrorInfo()
            any_.Unpack(info)
            if info.domain == DOMAIN and info.reason in BY_REASON:
                return info.reason, dict(info.metadata)
    return None


def from_status(
    code: Optional[grpc.StatusCode],
    message: str,
    trailing_metadata: Optional[Sequence[Tuple[str, object]]] = None,
) -> OpendsecError:
    """The SDK error for a failed status: its ErrorInfo reason, else its code."""
    for key, value in trailing_metadata or ():
        if key == _DETAILS_KEY and isinstance(value, (bytes, bytearray)):
            parsed = parse_error_info(bytes(value))
            if parsed is not None:
                reason, meta = parsed
                err = BY_REASON[reason](message, meta, code)
                err.has_error_info = True
                return err
    return class_for_code(code)(message, None, code)


def from_rpc_error(err: grpc.RpcError) -> OpendsecError:
    """Converts a ``grpc.RpcError`` (sync or aio) into the SDK error of its reason."""
    code = err.code() if hasattr(err, "code") else None  # type: ignore[attr-defined]
    details = err.details() if hasattr(err, "details") else ""  # type: ignore[attr-defined]
    trailing = err.trailing_metadata() if hasattr(err, "trailing_metadata") else None  # type: ignore[attr-defined]
    return from_status(code, details or "", trailing)


#: reason -> the exit code ``opendsecctl`` uses for it (docs/errors.md, stable).
EXIT_CODES: Dict[str, int] = {c.reason: 10 + i for i, c in enumerate(ALL)}


def from_exit_code(code: int, message: str) -> Optional[OpendsecError]:
    """The error an ``opendsecctl`` exit code stands for; ``None`` for a code that is no
    reason's (0, or 1: a local failure such as a file or the image store)."""
    for reason, c in EXIT_CODES.items():
        if c == code:
            return BY_REASON[reason](message)
    return None


def from_detail(reason: str, message: str) -> OpendsecError:
    """The error for an ``ErrorDetail`` inside a streamed or batched answer."""
    return BY_REASON.get(reason, Internal)(message)


__all__ = [
    "OpendsecError",
    "ALL",
    "BY_REASON",
    "EXIT_CODES",
    "from_exit_code",
    "from_rpc_error",
    "from_status",
    "from_detail",
    "class_for_code",
    *[c.__name__ for c in ALL],
]
