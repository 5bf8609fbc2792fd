"""What each rank's interpreter says of its own process and start, as one RESULT line: the command
line it was started with (``sys.orig_argv``, the executable and the script shown by name),
``sys.argv``, whether its main thread's ``native_id`` is its own, and whether ``tempfile`` has chosen
its directory yet (a fresh interpreter has not).

    torchrun --nproc-per-node 2 process_probe.py a b   # RESULT rank=0 orig_argv=EXE,-u,process_probe.py,a,b ...
"""

import os
import sys
import tempfile
import threading


def shown(word: str) -> str:
    if word == sys.executable:
        return "EXE"
    return os.path.basename(word) if word.endswith(".py") else word


rank = int(os.environ["RANK"])
orig = ",".join(shown(w) for w in sys.orig_argv)
argv = ",".join(shown(w) for w in sys.argv)
native = threading.main_thread().native_id == threading.get_native_id() == os.getpid()
print(f"RESULT rank={rank} orig_argv={orig} argv={argv} native_id_own={native} tempdir_chosen="
      f"{tempfile.tempdir is not None}", flush=True)
