"""A torchrun script that reports who it runs as (one JSON line), then joins the group and leaves."""

import json
import os
import sys
from pathlib import Path

import torch.distributed as dist

seen = {
    "uid": os.getuid(), "euid": os.geteuid(), "gid": os.getgid(), "groups": sorted(os.getgroups()),
    "umask": (lambda m: (os.umask(m), m)[1])(os.umask(0)),
    "env": {k: os.environ.get(k) for k in ("HOME", "USER", "LOGNAME", "SHELL", "MY_SETTING",
                                           "DAEMON_SETTING", "PYTHON_WRAPPER", "EXTRA_SETTING")},
    "executable": sys.executable, "cwd": os.getcwd(), "path0": sys.path[0], "environ": dict(os.environ),
    "cgroup": Path("/proc/self/cgroup").read_text(), "pid": os.getpid(),
}
print("ddpd-test-identity " + json.dumps(seen), flush=True)
dist.init_process_group("gloo")
dist.barrier()
dist.destroy_process_group()
