"""A script that writes known lines to stdout and stderr in three phases, each rank alike.

Phase A (``A-out <rank> <i>`` and ``A-err <rank> <i>``, three of each), then it waits for the file
argv[1]; phase B likewise; then it waits for argv[2] and writes phase C: 6000 numbered lines to each
stream (``C-out <rank> <nnnnn>``, about 84 KB: past a 64 KiB rotation limit), then ``END-out <rank>``
and ``END-err <rank>``. The waits are the test's handshakes: it decides when each phase is written.
"""

import os
import sys
import time

GATE_LIMIT = 300.0  # a forgotten gate must not keep a rank forever
rank = os.environ["RANK"]


def wait_for(path: str) -> None:
    deadline = time.monotonic() + GATE_LIMIT
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            sys.exit(f"{path} never appeared")
        time.sleep(0.02)


def both(tag: str, count: int, width: int = 0) -> None:
    for i in range(count):
        print(f"{tag}-out {rank} {i:0{width}d}")
        print(f"{tag}-err {rank} {i:0{width}d}", file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()


both("A", 3)
wait_for(sys.argv[1])
both("B", 3)
wait_for(sys.argv[2])
both("C", 6000, width=5)
print(f"END-out {rank}", flush=True)
print(f"END-err {rank}", file=sys.stderr, flush=True)
