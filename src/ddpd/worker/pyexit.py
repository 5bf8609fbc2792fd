"""A rank's way out, as `python script.py` ends, short of freeing what the script left.

Python's exit (`Py_FinalizeEx`, CPython 3.11) does, in order: `threading._shutdown` (the callbacks
registered with `threading._register_atexit`, such as `concurrent.futures`' join of its executors'
workers, then a join of every non-daemon thread), the `atexit` handlers (last registered first:
`logging.shutdown` flushes and closes every handler, `multiprocessing` ends its daemonic children
such as DataLoader workers), a flush of stdout and stderr, and only then the teardown of modules,
which frees what the script left and so closes its files and runs its objects' finalisers.

`leave` runs the first three steps in the same order, in the rank's main thread, with the
interpreter whole (the heartbeat thread goes on, so the daemon sees a rank at its exit work,
not a dead one), then closes every file the script left open (outermost first: a text wrapper
before its buffer, a gzip file before the file under it, so each writes what it holds, as the
teardown's `close` of each would) and leaves with `os._exit`. What is not done is the freeing of
the script's objects: a DDP model freed after its process group was destroyed runs gloo's
destructor under the GIL while a gloo thread waits for the GIL, and the rank hangs (torch 2.13,
`Reducer::~Reducer` -> `ProcessGroupGloo::~ProcessGroupGloo`). So `__del__` of an object still
referenced at exit does not run (files excepted, as said): docs/usage.md lists this difference.

A forked child of the rank (a DataLoader worker) must not keep the daemon's channel or the
store's listening socket: `forget_in_children` puts /dev/null in their place in every child the
rank forks, so the channel ends when the rank ends, whatever its children do.
"""

from __future__ import annotations

import atexit
import gc
import io
import os
import sys
import threading
from collections.abc import Callable, Iterable
from typing import Any, NoReturn


def leave(code: int, before_exit: Callable[[], None] = lambda: None) -> NoReturn:
    """Python's exit work (threads, atexit, open files), then `before_exit()`, then `os._exit(code)`."""
    exit_work()
    before_exit()
    flush_std()
    os._exit(code)


def exit_work() -> None:
    """What Python does on its way out before it frees anything: see the module."""
    shutdown = getattr(threading, "_shutdown", None)
    if shutdown is not None:
        try:
            shutdown()
        except BaseException as exc:  # as Python's own exit: said, then on with the rest
            _ignored("threading._shutdown", exc)
    atexit._run_exitfuncs()
    flush_std()
    close_files(_open_files())


def flush_std() -> None:
    for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        try:
            if stream is not None:
                stream.flush()
        except Exception:
            pass


def _ignored(where: str, exc: BaseException) -> None:
    try:
        print(f"Exception ignored in {where}: {exc!r}", file=sys.stderr, flush=True)
    except Exception:
        pass


def _standard() -> set[int]:
    keep: set[int] = set()
    for stream in (sys.stdin, sys.stdout, sys.stderr, sys.__stdin__, sys.__stdout__, sys.__stderr__):
        if stream is not None:
            keep.add(id(stream))
            buffer = getattr(stream, "buffer", None)
            if buffer is not None:
                keep.add(id(buffer))
                keep.add(id(getattr(buffer, "raw", None)))
    return keep


def _is_open(obj: Any) -> bool:
    # by its type only: `isinstance` falls back to `obj.__class__`, which an object's own
    # `__getattr__` may answer (torch's deprecated `reduce_op` warns on stderr)
    try:
        return issubclass(type(obj), io.IOBase) and not obj.closed
    except Exception:  # a half-built object: its own business
        return False


def _open_files() -> list[Any]:
    keep = _standard()
    return [obj for obj in gc.get_objects() if id(obj) not in keep and _is_open(obj)]


def _inner(obj: Any) -> Iterable[Any]:
    """What `obj` holds (its referents, and its instance dict's values): the files under it."""
    yield from gc.get_referents(obj)
    attrs = getattr(obj, "__dict__", None)
    if isinstance(attrs, dict):
        yield from attrs.values()


def close_files(files: list[Any]) -> None:
    """Close `files`, each before the files it wraps (so each writes into one still open)."""
    left = {id(f): f for f in files}
    while left:
        held = {id(inner) for f in left.values() for inner in _inner(f) if id(inner) in left and inner is not f}
        outer = [f for key, f in left.items() if key not in held] or list(left.values())  # a cycle: any order
        for f in outer:
            left.pop(id(f), None)
            try:
                f.close()
            except Exception as exc:
                _ignored(f"closing {f!r}", exc)


def forget_in_children(fds: Callable[[], list[int]]) -> None:
    """In every child this process forks from now on, /dev/null takes the place of `fds()`."""

    def forget() -> None:
        try:
            null = os.open(os.devnull, os.O_RDWR)
        except OSError:
            return
        try:
            for fd in fds():
                try:
                    os.dup2(null, fd, inheritable=False)
                except OSError:
                    pass
        finally:
            os.close(null)

    os.register_at_fork(after_in_child=forget)
