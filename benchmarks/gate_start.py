"""The launch gate's cost per start: ``python -m benchmarks.gate_start shell|python [N]`` (as root).

N starts in a row of ``/bin/true`` as ``nobody`` in /tmp with 33 environment variables, through
the shell gate (dash, setpriv, the user's dash, env) or the Python gate, each waited for; prints
the wall time and the CPU of the gate's processes (the children's rusage) per start.
"""

from __future__ import annotations

import argparse
import resource
import time

from ddpd.daemon.contain.gate import spawn_gated
from ddpd.daemon.contain.identity import Identity

NOBODY = 65534
ENV = {"PATH": "/usr/bin:/bin", "HOME": "/", "LANG": "C.UTF-8", **{f"VAR{i}": "x" * 40 for i in range(30)}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("gate", choices=("shell", "python"))
    p.add_argument("n", type=int, nargs="?", default=300)
    args = p.parse_args()
    who = Identity.of(NOBODY)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    for _ in range(args.n):
        proc = spawn_gated(["/bin/true"], ENV, "/tmp", who, lambda pid: None, shell=args.gate == "shell")
        if proc.wait() != 0:
            raise SystemExit(f"the {args.gate} gate's start of /bin/true exited {proc.returncode}")
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    print(f"{args.gate} gate: {1000 * wall / args.n:.2f} ms wall, {1000 * cpu / args.n:.2f} ms CPU of its "
          f"processes per start ({args.n} starts)")


if __name__ == "__main__":
    main()
