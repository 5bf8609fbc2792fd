"""The live event stream: fan-out of events to followers (`events -f`, watch, metrics, status)."""

from __future__ import annotations

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from ..protocol.control import EventView


class EventBus:
    """Fan-out of events to followers; a follower too slow to keep up is dropped, never waited on."""

    def __init__(self, buffer: int = 10_000) -> None:
        self._subs: set[MemoryObjectSendStream[EventView]] = set()
        self._buffer = buffer

    def subscribe(self) -> MemoryObjectReceiveStream[EventView]:
        send, recv = anyio.create_memory_object_stream[EventView](self._buffer)
        self._subs.add(send)
        return recv

    def publish(self, event: EventView) -> None:
        for send in list(self._subs):
            try:
                send.send_nowait(event)
            except (anyio.WouldBlock, anyio.BrokenResourceError, anyio.ClosedResourceError):
                self._subs.discard(send)
                send.close()
