"""Torch's elastic rendezvous as a daemon uses it: the endpoint's store, the handler, blocking calls.

- `endpoint_address`: whether the endpoint's host is one of this machine's (or network namespace's)
  addresses, found by binding it: the daemon there serves the rendezvous store (`serve_store`, on a
  socket it bound itself); a taken port is a NodeError naming it (`check_endpoint`, at submit).
- `route_address`: this node's address on the way to the endpoint (what the other nodes reach).
- `make_handler`: torch's ``DynamicRendezvousHandler`` over the ``c10d`` backend, with ddpd's
  timeouts; it never starts a store server of its own (the daemon serves each attempt's), and it
  publishes each round's bootstrap address in that round.
- `call_blocking`: a blocking torch call in a daemon thread of its own, awaited with a deadline and
  abandoned on cancellation, so a store that no longer answers holds neither the event loop, nor
  the attempt, nor the daemon's exit.
"""

from __future__ import annotations

import errno
import os
import socket
import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any, TypeVar, cast

import anyio
import anyio.from_thread
import anyio.lowlevel

from ...protocol.nodes import parse_endpoint
from ...protocol.spec import JobSpec
from ..attempt.rendezvous import RendezvousError, listen_on

T = TypeVar("T")
CLOSE_TIMEOUT = 10.0


class NodeError(RendezvousError):
    """The rendezvous cannot be reached, served or formed: the attempt fails with this text."""


def endpoint_address(host: str, port: int) -> str | None:
    """Blocking: the endpoint's address when it is one of this machine's (or namespace's), else None.

    A local address binds; a taken port on it is a NodeError naming it."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as exc:
        raise NodeError(f"rdzv_endpoint: cannot resolve {host!r}: {exc}") from None
    for family, _, _, _, addr in infos:
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind(addr[:2])
            except OSError as exc:
                if exc.errno == errno.EADDRNOTAVAIL:
                    continue
                raise NodeError(f"rdzv_endpoint: port {port} on {addr[0]} is taken ({exc.strerror}); "
                                "this daemon serves the rendezvous there") from None
            return str(addr[0])
    return None


def check_endpoint(spec: JobSpec, owner_uid: int = 0) -> None:
    """Blocking, at submit: on the endpoint's host its port must be free (NodeError names it), and
    not a privileged one unless root submits (the daemon binds it for the job)."""
    if spec.rdzv_endpoint:
        host, port = parse_endpoint(spec.rdzv_endpoint)
        if endpoint_address(host, port) is not None and port < 1024 and owner_uid != 0:
            raise NodeError(f"rdzv_endpoint: port {port} is privileged: only root may have the daemon serve it")


def route_address(host: str, port: int) -> str:
    """Blocking: this node's address on the way to the endpoint (what the other nodes reach it at)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as sock:
        try:
            sock.connect((host, port))
        except OSError as exc:
            raise NodeError(f"rdzv_endpoint: no route to {host}:{port}: {exc.strerror}") from None
        return str(sock.getsockname()[0])


def serve_store(address: str, port: int, timeout: float) -> Any:
    import torch.distributed as dist

    try:
        sock = listen_on(address, port)
    except OSError as exc:
        raise NodeError(f"rdzv_endpoint: cannot bind port {port} on {address}: {exc.strerror}") from None
    fd = sock.detach()
    try:
        return dist.TCPStore(address, port, is_master=True, wait_for_workers=False, master_listen_fd=fd,
                             timeout=timedelta(seconds=timeout))
    except BaseException:
        os.close(fd)
        raise


def make_handler(store: Any, run_id: str, lo: int, hi: int, local: str, join: float, last_call: float,
             keep_alive: float) -> Any:
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
        DynamicRendezvousHandler,
        RendezvousTimeout,
    )

    class Handler(DynamicRendezvousHandler):  # type: ignore[misc]
        def _create_tcp_store_server(self, master_addr: Any, master_port: Any) -> Any:
            return NoServer()  # the daemon serves each attempt's worker store itself

        def next_rendezvous(self) -> Any:
            # torch keeps the first round's bootstrap address and publishes it only then, while a node
            # that joins a later round waits for it under that round's prefix: published every round
            self._bootstrap_store_info = None
            self._shared_tcp_store_server = None
            return super().next_rendezvous()

    backend = C10dRendezvousBackend(store, run_id)
    interval = max(1, round(keep_alive / 3))
    timeout = RendezvousTimeout(join=timedelta(seconds=join), last_call=timedelta(seconds=last_call),
                                close=timedelta(seconds=CLOSE_TIMEOUT), heartbeat=timedelta(seconds=interval))
    return Handler.from_backend(run_id, store, backend, lo, hi, local_addr=local, timeout=timeout,
                                keep_alive_interval=interval, keep_alive_max_attempt=3)


class NoServer:
    port = 0


async def call_blocking(fn: Callable[..., T], *args: Any, timeout: float) -> T:
    """`fn(*args)` in a daemon thread of its own, awaited at most `timeout` seconds.

    A store call to a node that is gone blocks until the store's own timeout: abandoned here,
    and in a daemon thread, so that neither the attempt nor the daemon's exit waits for it."""
    done = anyio.Event()
    token = anyio.lowlevel.current_token()
    box: list[Any] = []

    def run() -> None:
        try:
            box.append((True, fn(*args)))
        except BaseException as exc:  # handed to the awaiting task
            box.append((False, exc))
        try:
            anyio.from_thread.run_sync(done.set, token=token)
        except RuntimeError:  # the event loop is gone (abandoned, the daemon stopping)
            pass

    threading.Thread(target=run, name="ddpd-rendezvous", daemon=True).start()
    with anyio.fail_after(timeout):
        await done.wait()
    ok, value = box[0]
    if not ok:
        raise value
    return cast(T, value)
