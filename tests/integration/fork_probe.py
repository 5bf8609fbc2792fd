"""A torchrun script that reports what a fresh rank has (one JSON line), then joins the group and
leaves: its process, `sys` state, first random draws, thread pools, descriptors and environment.
tests/integration/test_forkserver.py runs it cold and forked and compares."""

import json
import os
import random
import sys
import tempfile
import threading
from pathlib import Path

import torch
import torch.distributed as dist

import __main__

tasks = len(os.listdir("/proc/self/task"))


def fd_kind(fd: str) -> str:
    try:
        target = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return "gone"
    return target.split(":")[0] if ":" in target else ("dev" if target.startswith("/dev/") else "file")


fds = sorted(fd_kind(fd) for fd in os.listdir("/proc/self/fd"))
try:
    import numpy

    numpy_draw = float(numpy.random.random())
except ImportError:
    numpy_draw = None
seen = {
    "pid": os.getpid(), "ppid": os.getppid(), "pgid": os.getpgid(0), "sid": os.getsid(0),
    "uid": os.getuid(), "gid": os.getgid(), "groups": sorted(os.getgroups()),
    "umask": (lambda m: (os.umask(m), m)[1])(os.umask(0)),
    "argv": sys.argv, "path0": sys.path[0], "main": getattr(__main__, "__file__", None), "name": __name__,
    "executable": sys.executable, "cwd": os.getcwd(), "environ": dict(os.environ),
    "cgroup": Path("/proc/self/cgroup").read_text(),
    "random": random.random(), "numpy": numpy_draw, "torch": float(torch.rand(1).item()),
    "torch_seed": torch.initial_seed(), "threads": torch.get_num_threads(),
    "interop": torch.get_num_interop_threads(), "tasks": tasks, "fds": fds,
    "modules": "torch.distributed" in sys.modules,
    # a fresh interpreter's: its main thread's own id, and no temporary directory chosen yet
    "main_native_id": threading.main_thread().native_id == threading.get_native_id(),
    "tempdir": tempfile.tempdir,
}
a = torch.randn(256, 256)
seen["mm"] = float((a @ a).sum().item() != 0)  # the intra-op pool works (a fork-broken one hangs here)
print("ddpd-fork-probe " + json.dumps(seen), flush=True)
dist.init_process_group("gloo")
dist.barrier()
dist.destroy_process_group()
