"""Frames and results of the control protocol, as the client reads them (no I/O here).

Encoding a request, decoding and matching a reply, turning an error reply into `RemoteError` and a
result into its typed shape. Results of daemons that predate paging and cancel reports (a bare
list for `list`, a JobView for `cancel`) are converted to the current shapes.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, TypeVar

import msgspec

from ddpd.protocol import Decoder, FrameError, JobSpec, JobState, RemoteError, SpecError, check_spec, encode
from ddpd.protocol.control import CancelResult, End, Error, Item, JobPage, JobView, Ok, Reply, Request

from .errors import ProtocolError

T = TypeVar("T")

RawRequest = Request | Mapping[str, Any]
"""A typed request (its `id` is sent as given) or a plain mapping (given an id if it has none)."""

_reply_decoder: Decoder[Reply] = Decoder(Reply)


def with_id(req: RawRequest, req_id: int) -> RawRequest:
    if isinstance(req, Mapping) and "id" not in req:
        return {**req, "id": req_id}
    return req


def id_of(req: RawRequest) -> Any:
    return req.get("id") if isinstance(req, Mapping) else req.id


def encode_request(req: RawRequest) -> bytes:
    try:
        return encode(req)
    except FrameError as exc:
        raise RemoteError(exc.code, exc.message) from None


def parse_reply(line: bytes) -> Reply:
    try:
        return _reply_decoder.decode_frame(line)
    except FrameError as exc:
        raise ProtocolError(f"bad reply from the daemon: {exc.message}") from None


def check_id(reply: Reply, req_id: Any) -> Reply:
    if reply.id is not None and reply.id != req_id:
        raise ProtocolError(f"reply for request {reply.id} while waiting for request {req_id}")
    return reply


def result_of(reply: Reply) -> Any:
    """The result of an Ok reply; an Error reply raises RemoteError with its code and message."""
    if isinstance(reply, Ok):
        return reply.result
    if isinstance(reply, Error):
        raise RemoteError(reply.code, reply.message)
    raise ProtocolError(f"unexpected {type(reply).__name__.lower()} reply to a request")


def convert(value: Any, type_: type[T]) -> T:
    try:
        return msgspec.convert(value, type_)
    except msgspec.ValidationError as exc:
        raise ProtocolError(f"bad result from the daemon: {exc}") from None


def stream_step(reply: Reply, type_: type[T]) -> T | None:
    """The item a stream reply carries; None at the end marker; raises on an error reply."""
    if isinstance(reply, Item):
        return convert(reply.item, type_)
    if isinstance(reply, End):
        return None
    if isinstance(reply, Error):
        raise RemoteError(reply.code, reply.message)
    raise ProtocolError("unexpected ok reply inside a stream")


def job_page(value: Any) -> JobPage:
    """A `list` result: a JobPage, or the bare list of an older daemon (one page, no next)."""
    if isinstance(value, list):
        return JobPage(jobs=convert(value, list[JobView]))
    return convert(value, JobPage)


def cancel_result(value: Any, force: bool) -> CancelResult:
    """A `cancel` result: a CancelResult, or the JobView of an older daemon (its action inferred)."""
    if isinstance(value, dict) and "action" in value:
        return convert(value, CancelResult)
    job = convert(value, JobView)
    action = "cancelled" if job.state == JobState.CANCELLED else "killing" if force else "stopping"
    return CancelResult(action=action, job=job)


def build_spec(fields: Mapping[str, Any]) -> JobSpec:
    """A JobSpec from plain values, checked as the daemon checks it; SpecError names the field.

    The spec returned is the one given (defaults left for the daemon to fill in).
    """
    try:
        spec = msgspec.convert(fields, JobSpec)
    except msgspec.ValidationError as exc:
        message, sep, path = str(exc).rpartition(" - at `")
        if not sep:
            unknown = re.search(r"unknown field `([^`]*)`", str(exc))
            raise SpecError(unknown.group(1) if unknown else "spec", str(exc)) from None
        field = path.rstrip("`").removeprefix("$").lstrip(".") or "spec"
        raise SpecError(field, message) from None
    check_spec(spec)
    return spec
