"""Each rank creates a file and a directory in OUTDIR and prints their modes (what its umask made).
Usage: show_umask.py OUTDIR"""

from __future__ import annotations

import os
import stat
import sys

rank = os.environ["RANK"]
path = os.path.join(sys.argv[1], f"file-{rank}")
with open(path, "w") as f:
    f.write(rank)
os.mkdir(os.path.join(sys.argv[1], f"dir-{rank}"))
modes = [oct(stat.S_IMODE(os.stat(os.path.join(sys.argv[1], n)).st_mode)) for n in (f"file-{rank}", f"dir-{rank}")]
print(f"umask-probe rank {rank} file {modes[0]} dir {modes[1]}", flush=True)
