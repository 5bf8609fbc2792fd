"""A warm-pool interpreter never touches the CUDA runtime before its assignment.

The CUDA runtime reads ``CUDA_VISIBLE_DEVICES`` once, at its first call (``cudaGetDeviceCount``
through ``torch.cuda.is_available``/``device_count``, or a context through ``_lazy_init``). A
pooled interpreter learns its GPUs only from the assignment, so any such call during its start
(``import torch`` and the DDP pre-imports) would pin it to the daemon's view of the GPUs.

One real pooled interpreter (``ddpd.worker.bootstrap.main --pool``, the interpreter pool's code
path; and a fork server, ``--fork-server``, the default pool's, whose ranks are its forks) starts
under a shim that wraps every CUDA entry point right after ``import torch``, before the
pre-imports, and writes each call with its stack to a record file. The test waits for its hello,
reads the record, and fails on any call. Works on a CPU-only torch too: the wrappers see the call
whether or not CUDA is compiled in.
"""

from __future__ import annotations

import os
import select
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ddpd.protocol import Decoder, LineSplitter
from ddpd.protocol.channel import Hello, WorkerMessage

from ..conftest import REPO

TIMEOUT = 120.0  # a cold `import torch` and the pre-imports on a busy machine

# torch.cuda functions that reach the CUDA runtime or read CUDA_VISIBLE_DEVICES, and the torch._C
# bindings below them (those present in this build)
CUDA_ENTRY_POINTS = (
    "is_available", "device_count", "_lazy_init", "init", "current_device", "set_device",
    "get_device_properties", "get_device_name", "get_device_capability", "mem_get_info", "synchronize",
    "is_bf16_supported", "_device_count_nvml", "_raw_device_count_nvml", "_device_count_amdsmi",
)
C_ENTRY_POINTS = ("_cuda_getDeviceCount", "_cuda_init", "_cuda_getDevice", "_cuda_setDevice",
                  "_cuda_isDriverSufficient", "_cuda_getDriverVersion")

SHIM = """
import functools, sys, traceback
record = open(sys.argv[1], "a", buffering=1)
import torch
import torch.cuda

def watch(owner, label, name):
    original = getattr(owner, name, None)
    if original is None or not callable(original):
        return
    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        record.write(f"CALL {label}.{name}\\n" + "".join(traceback.format_stack(limit=15)) + "--\\n")
        return original(*args, **kwargs)
    setattr(owner, name, wrapper)

for name in CUDA:
    watch(torch.cuda, "torch.cuda", name)
for name in C:
    watch(torch._C, "torch._C", name)
record.write("WATCHING\\n")

from ddpd.worker import runtime

send = runtime.Runtime.send
def send_checked(self, message):
    if type(message).__name__ == "Hello":
        record.write(f"HELLO initialized={torch.cuda.is_initialized()}\\n")
    return send(self, message)
runtime.Runtime.send = send_checked

send_frame = runtime.Channel.send  # a fork server says hello on its channel itself
def send_frame_checked(self, message, *args, **kwargs):
    if type(message).__name__ == "Hello":
        record.write(f"HELLO initialized={torch.cuda.is_initialized()}\\n")
    return send_frame(self, message, *args, **kwargs)
runtime.Channel.send = send_frame_checked

from ddpd.worker.bootstrap import main
main(sys.argv[2:])
"""


def start_pooled(record: Path, log: Path, mode: str) -> tuple[subprocess.Popen[bytes], socket.socket]:
    ours, theirs = socket.socketpair()
    code = f"CUDA = {CUDA_ENTRY_POINTS!r}\nC = {C_ENTRY_POINTS!r}\n" + SHIM
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")])}
    env.pop("CUDA_VISIBLE_DEVICES", None)  # as a daemon without it: the pool sees every GPU
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-c", code, str(record), "--fd", str(theirs.fileno()), "--parent", str(os.getpid()),
             mode],
            pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
            cwd=REPO, env=env, process_group=0,
        )
    theirs.close()
    return proc, ours


def wait_hello(sock: socket.socket, log: Path) -> Hello:
    deadline = time.monotonic() + TIMEOUT
    splitter, decoder = LineSplitter(), Decoder(WorkerMessage)
    while True:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([sock], [], [], left)[0]:
            raise AssertionError(f"no hello from the pooled interpreter; log:\n{log.read_text()}")
        data = sock.recv(65536)
        assert data, f"channel closed before the hello; log:\n{log.read_text()}"
        for line in splitter.feed(data):
            message = decoder.decode_frame(line)
            if isinstance(message, Hello):
                return message


@pytest.mark.parametrize(("mode", "exit_code"), [("--pool", -signal.SIGKILL), ("--fork-server", 0)])
def test_pooled_interpreter_start_makes_no_cuda_call(tmp_path: Path, mode: str, exit_code: int) -> None:
    """`exit_code`: at the channel's end a pooled interpreter kills its own group, a server exits."""
    record, log = tmp_path / "cuda-calls.txt", tmp_path / "worker.log"
    proc, sock = start_pooled(record, log, mode)
    try:
        hello = wait_hello(sock, log)
        assert hello.pid == proc.pid
        text = record.read_text()
        assert "WATCHING" in text  # the wrappers were in place before the pre-imports
        calls = text.split("CALL ")[1:]
        assert calls == [], "CUDA touched before the assignment:\n" + "\n".join(calls)
        assert "HELLO initialized=False" in text, text
    finally:
        sock.close()  # the worker sees EOF and leaves (it kills only its own group)
        try:
            code = proc.wait(TIMEOUT)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            code = proc.wait(TIMEOUT)
    assert code == exit_code
    with pytest.raises(ProcessLookupError):
        os.killpg(proc.pid, 0)
