"""Each rank creates a file and a directory the way a checkpoint writer does (plain ``open`` and
``os.makedirs``, no explicit mode) and prints their modes, which only the umask decides.

    umask 027; torchrun --nproc-per-node 2 umask_probe.py   # RESULT rank=0 file=0640 dir=0750 ...
"""

import os
import stat

rank = int(os.environ["RANK"])
path = f"out/rank{rank}.txt"
with open(path, "w") as f:
    f.write(f"rank {rank}\n")
os.makedirs(f"out/dir-rank{rank}")
file_mode = stat.S_IMODE(os.stat(path).st_mode)
dir_mode = stat.S_IMODE(os.stat(f"out/dir-rank{rank}").st_mode)
print(f"RESULT rank={rank} file={file_mode:04o} dir={dir_mode:04o}", flush=True)
