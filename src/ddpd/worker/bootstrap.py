"""Process bootstrap: pdeathsig, faulthandler, the reader and heartbeat threads, and the exit path.

The way out is Python's, short of the module teardown (`pyexit`): the Result or Failure is sent
first (what the script did: its exit work cannot change it, as under python), then the script's
exit work runs (non-daemon threads joined, atexit handlers, open files closed), the store's host
serves until released, and the rank leaves with ``os._exit`` (freeing a DDP model
after ``destroy_process_group`` can hang in gloo's destructor, and C++ static destructors
sometimes abort with "terminate called without an active exception").
"""

from __future__ import annotations

import ctypes
import faulthandler
import importlib
import os
import platform
import queue
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from ddpd.protocol.channel import (
    AskStacks,
    Assign,
    DumpStacks,
    Failure,
    Heartbeat,
    Hello,
    Reform,
    Release,
    Result,
    Stop,
)
from ddpd.protocol.framing import PROTOCOL_VERSION
from ddpd.protocol.spec import DEFAULT_UMASK
from ddpd.protocol.worker import EXIT_ORPHANED, parse_worker_args

from . import api
from .pyexit import forget_in_children, leave
from .runtime import Channel, Runtime
from .stacks import current_stacks, dump_flight_recorder
from .storehost import hold_store, serve_store
from .tracebacks import user_traceback

PR_SET_PDEATHSIG = 1

# Modules that DistributedDataParallel's constructor imports lazily (measured on torch 2.13: about
# 1 s of a cold start); a warm-pool interpreter imports them before its hello.
POOL_IMPORTS = (
    "torch.distributed",
    "torch.nn.parallel",
    "torch._dynamo",
    "torch.distributed.algorithms._comm_hooks",
    "torch.distributed._composable.replicate",
    "torch.distributed.fsdp",
    "torch.distributed.tensor",
    "torch.distributed.nn",
    "torch.utils.data.distributed",
    "torch.profiler",
)


def pool_imports() -> None:
    """Import what DDP imports lazily, leaving the environment and `tempfile`'s directory as they
    were: some of these modules set variables as they load (torch._inductor:
    TORCHINDUCTOR_CACHE_DIR), which a cold start of the job would not have before its own code ran,
    and ask `tempfile.gettempdir()`, which keeps its answer (from this process's TMPDIR, where the
    job's own TMPDIR, applied on assignment, decides it in a cold start)."""
    import tempfile

    before, tempdir = dict(os.environ), tempfile.tempdir
    for name in POOL_IMPORTS:
        importlib.import_module(name)
    for key in [k for k in os.environ if k not in before]:
        del os.environ[key]
    os.environ.update(before)
    tempfile.tempdir = tempdir


def set_pdeathsig(sig: int = signal.SIGKILL) -> None:
    """Ask the kernel to send `sig` when the parent (the daemon) dies."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, os.strerror(errno))


def read_daemon(runtime: Runtime, assignments: queue.Queue[Assign]) -> None:
    """The reader thread: dispatch daemon frames until EOF, then kill the process group."""
    why = "channel closed"
    try:
        for message in runtime.channel.frames():
            match message:
                case Assign():
                    assignments.put(message)
                case Stop(signal=signum):
                    runtime.stop_requested.set()
                    if signum:
                        forward_stop_signal(signum)
                case DumpStacks():
                    faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
                    dump_hang_evidence()
                case AskStacks(request=request):
                    runtime.send(current_stacks(request))
                case Release():
                    runtime.released.set()
                case Reform(generation=generation):
                    runtime.reforms.put(generation)
                    if "torch.distributed" in sys.modules:
                        from .reform import abort_nccl

                        abort_nccl()
    except Exception as exc:  # OSError, or a bug: either way nobody listens to the daemon any more
        why = f"channel error: {exc!r}"
    runtime.channel.daemon_gone(why)


def dump_hang_evidence() -> None:
    """A hang: NCCL's flight recorder too, beside the rank log (said in the log where it does not apply)."""
    try:
        note = dump_flight_recorder()
    except OSError as exc:
        note = f"flight recorder: cannot write its dump ({exc})"
    print(f"ddpd: {note}", file=sys.stderr, flush=True)


def _dump_handler(signum: int, frame: object) -> None:
    """ddpd's own Python-level SIGUSR1 handler: nothing (the wakeup fd carries the signal to the dump
    thread; faulthandler has written the stacks before it)."""


_expected_usr1 = [0]  # SIGUSR1s raised for the script's handler: no hang evidence for those


def forward_stop_signal(signum: int) -> bool:
    """Raise the stop signal in this rank where the script handles it (a Python handler of its own, as
    a Slurm job does for --signal); never where it would take the default action (end the rank) or
    reach ddpd's own dump handler. True if it was raised."""
    handler = signal.getsignal(signum)
    if not callable(handler) or handler is _dump_handler:
        return False
    if signum == signal.SIGUSR1:
        _expected_usr1[0] += 1
    os.kill(os.getpid(), signum)  # the handler runs in the main thread, between two bytecodes
    return True


def watch_dump_signal() -> None:
    """SIGUSR1 (the daemon's hang dump): faulthandler writes every thread's stack at once, even while
    a C call holds the GIL; then the flight recorder is dumped from a thread of its own.

    faulthandler chains to Python's own handler, which writes the signal's number to the wakeup
    fd (from the signal handler, whatever the main thread does); `dump_signalled` reads it. A script
    that sets its own wakeup fd (an asyncio loop) or SIGUSR1 handler takes this over: the daemon's
    DumpStacks frame is the fallback.
    """
    read_fd, write_fd = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    os.set_blocking(read_fd, True)
    signal.signal(signal.SIGUSR1, _dump_handler)
    signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True, chain=True)
    threading.Thread(target=dump_signalled, args=(read_fd,), name="ddpd-dump", daemon=True).start()


def dump_signalled(read_fd: int) -> None:
    """The dump thread: the hang evidence beyond the stacks, on each SIGUSR1 (other signals ignored)."""
    while data := os.read(read_fd, 64):
        if signal.SIGUSR1 in data:
            if _expected_usr1[0]:  # the stop signal, raised for the script's own handler
                _expected_usr1[0] -= 1
                continue
            dump_hang_evidence()


def send_heartbeats(runtime: Runtime, interval: float) -> None:
    """The heartbeat thread: a Heartbeat carrying the step counter every `interval` seconds."""
    while True:
        runtime.send(Heartbeat(step=runtime.step))
        time.sleep(interval)


def redirect_output(path: str, err_path: str = "") -> None:
    """Append stdout (fd 1) to `path` and stderr (fd 2, so faulthandler and C++ output too) to
    `err_path` (or to `path` too)."""
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    targets = [(path, (1,)), (err_path, (2,))] if err_path else [(path, (1, 2))]
    for target, fds in targets:
        fd = os.open(target, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            for out in fds:
                os.dup2(fd, out)
        finally:
            os.close(fd)


def apply_assignment(assign: Assign) -> None:
    """Join the attempt's process group, take its log, environment and working directory.

    A warm-pool interpreter started in another directory: `sys.path[0]` (its start directory,
    as `python -m` set it) becomes the new working directory, as a cold start there would have.
    """
    if assign.pgid > 0 and os.getpgrp() != assign.pgid:
        os.setpgid(0, assign.pgid)
    if assign.log_path:
        redirect_output(assign.log_path, assign.err_path)
    for key in assign.unset:
        os.environ.pop(key, None)
    os.environ.update(assign.env)
    os.umask(DEFAULT_UMASK if assign.spec.umask is None else assign.spec.umask)  # the submitter's
    if assign.spec.workdir:
        start = os.getcwd()
        os.chdir(assign.spec.workdir)
        if sys.path and sys.path[0] == start:
            sys.path[0] = os.getcwd()
    threads = os.environ.get("OMP_NUM_THREADS")
    if threads:
        import torch

        torch.set_num_threads(max(1, int(threads)))
    if assign.sched_batch:
        batch_policy()


def batch_policy() -> None:
    """Every thread of this rank to SCHED_BATCH; the threads it starts from now on (gloo's, the
    script's, its DataLoader workers) inherit it. A woken batch thread waits for the running one's
    time slice instead of preempting it: gloo's threads wake hundreds of times a second per rank and
    each wake-up used to interrupt the training thread (docs/operations.md, `cpu_rank_policy`). A
    policy this rank may not take (a pooled interpreter left at SCHED_IDLE without the right to
    leave it) is said in the rank log, and the rank runs on as it was."""
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setscheduler(int(tid), os.SCHED_BATCH, os.sched_param(0))
        except ProcessLookupError:
            continue  # a thread that ended meanwhile
        except OSError as exc:
            print(f"ddpd: thread {tid} keeps its scheduling policy: {exc}", file=sys.stderr, flush=True)


def run(runtime: Runtime, assign: Assign) -> Result:
    if assign.spec.script is not None:
        from .script import run_script

        return run_script(runtime, assign)
    from .loop import run_task

    return run_task(runtime, assign)


def finish(runtime: Runtime, code: int, then: Callable[[], None] = lambda: None) -> NoReturn:
    """Python's exit work (`pyexit`), then `then()`, then `os._exit(code)`."""
    leave(code, then)


def fail(runtime: Runtime, exc: BaseException, code: int) -> NoReturn:
    """The full traceback to the rank log; the Failure frame's starts at the user's first frame."""
    print("".join(traceback.format_exception(exc)), file=sys.stderr, end="", flush=True)
    runtime.send(Failure(error=type(exc).__name__, message=str(exc), traceback=user_traceback(exc),
                         phase=runtime.phase))
    finish(runtime, code)


def exit_status(runtime: Runtime, exc: SystemExit, script: bool) -> NoReturn:
    """A non-zero SystemExit. In a script it is the exit status, as under python itself, with no
    traceback: `sys.exit(3)` exits 3 and sends no Failure (the root cause is "exit 3");
    `sys.exit("text")` prints the text and exits 1, its Failure carrying the text only.
    In a task it is a failure like any other, with its traceback."""
    code = (exc.code & 0xFF or 1) if isinstance(exc.code, int) else 1
    if not isinstance(exc.code, int):
        print(exc.code, file=sys.stderr, flush=True)
        if script:
            runtime.send(Failure(error="SystemExit", message=str(exc.code), traceback="", phase=runtime.phase))
    if script:
        finish(runtime, code)
    fail(runtime, exc, code)


def fork_server(fd: int, parent: int, daemon_pgid: int) -> int:
    """A fork server (`forkserver`): import what a rank needs, then fork workers on request; in each
    forked worker, the descriptor of its own channel."""
    import torch

    pool_imports()
    from .forkserver import serve_forks

    sock = socket.socket(fileno=fd)
    sock.setblocking(True)
    return serve_forks(sock, parent, daemon_pgid, Hello(version=PROTOCOL_VERSION, pid=os.getpid(),
                                                        python=platform.python_version(), torch=str(torch.__version__)))


def main(argv: Sequence[str] | None = None) -> NoReturn:
    args = parse_worker_args(argv)
    set_pdeathsig()
    if os.getppid() != args.parent:
        os._exit(EXIT_ORPHANED)
    daemon_pgid = os.getpgid(args.parent)
    faulthandler.enable(file=sys.stderr, all_threads=True)
    if args.agent:
        from .agent import serve

        serve(socket.socket(fileno=args.fd), daemon_pgid)
    fd = args.fd
    if args.fork_server:  # forks pooled workers; returns in each of them only, with its channel
        fd = fork_server(args.fd, args.parent, daemon_pgid)
        from .forkserver import pooled_argv

        sys.argv, sys.orig_argv = pooled_argv(sys.argv, fd), pooled_argv(sys.orig_argv, fd)
    watch_dump_signal()

    import torch

    if args.pool:
        pool_imports()

    sock = socket.socket(fileno=fd)
    sock.setblocking(True)
    runtime = Runtime(Channel(sock, daemon_pgid))
    runtime.private_fds.append(sock.fileno())
    forget_in_children(lambda: runtime.private_fds)
    api.bind(runtime)
    assignments: queue.Queue[Assign] = queue.Queue()
    threading.Thread(target=read_daemon, args=(runtime, assignments), name="ddpd-reader", daemon=True).start()
    runtime.send(Hello(version=PROTOCOL_VERSION, pid=os.getpid(), python=platform.python_version(),
                       torch=str(torch.__version__)))

    assign = assignments.get()
    try:
        apply_assignment(assign)
        if assign.serve_store:
            serve_store(runtime, assign)
    except BaseException as exc:
        fail(runtime, exc, 1)
    threading.Thread(target=send_heartbeats, args=(runtime, assign.heartbeat_interval),
                     name="ddpd-heartbeat", daemon=True).start()
    result: Any
    try:
        result = run(runtime, assign)
    except SystemExit as exc:
        if exc.code is None or exc.code == 0:
            result = Result(steps=runtime.step, loss=runtime.loss)
        else:
            exit_status(runtime, exc, assign.spec.script is not None)
    except BaseException as exc:
        fail(runtime, exc, 1)
    runtime.finished()
    runtime.send(result)  # what the script did; its exit work cannot change it (as under python)
    finish(runtime, 0, lambda: hold_store(runtime, assign))
