"""The live event stream: fan-out of events to followers (`events -f`, watch, metrics, status), and to
listeners called as each event is published (the curves: they see every event, in order, before any
reply that follows it), in the order the events were stamped (`Outbox`)."""

from __future__ import annotations

from collections.abc import Callable

import anyio
import structlog
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from ...protocol.control import EventView

log = structlog.get_logger("ddpd")


class EventBus:
    """Fan-out of events to followers; a follower too slow to keep up is dropped, never waited on."""

    def __init__(self, buffer: int = 10_000) -> None:
        self._subs: set[MemoryObjectSendStream[EventView]] = set()
        self._buffer = buffer
        self._listeners: list[Callable[[EventView], None]] = []

    def subscribe(self) -> MemoryObjectReceiveStream[EventView]:
        send, recv = anyio.create_memory_object_stream[EventView](self._buffer)
        self._subs.add(send)
        return recv

    def listen(self, listener: Callable[[EventView], None]) -> None:
        """Call `listener` with every event as it is published: it runs on the publisher's stack, so it
        must be quick and never block; an exception it raises is logged and the event goes on."""
        self._listeners.append(listener)

    def publish(self, event: EventView) -> None:
        for listener in self._listeners:
            try:
                listener(event)
            except Exception:
                log.exception("bus.listener_failed", kind=event.kind, job_id=event.job_id)
        for send in list(self._subs):
            try:
                send.send_nowait(event)
            except (anyio.WouldBlock, anyio.BrokenResourceError, anyio.ClosedResourceError):
                self._subs.discard(send)
                send.close()


class Outbox:
    """Publication in stamp order: `take` a place when an event is stamped, `put` its view (None: nothing
    to publish, its write was cancelled) when it is ready; the views are published in the places' order,
    each as soon as every earlier one was put (by whichever caller puts last)."""

    def __init__(self, bus: EventBus) -> None:
        self.bus = bus
        self._first = 0  # the place at the head
        self._ready: dict[int, EventView | None] = {}
        self._next = 0

    def take(self) -> int:
        place, self._next = self._next, self._next + 1
        return place

    def put(self, place: int, view: EventView | None) -> None:
        self._ready[place] = view
        while self._first in self._ready:
            ready = self._ready.pop(self._first)
            self._first += 1
            if ready is not None:
                self.bus.publish(ready)
