"""A torchrun script that joins (gloo starts its threads), then prints on its `ddpd-test-env` line
the scheduling policy of each of its threads, of a thread it starts, and of a child process."""

import json
import os
import subprocess
import sys
import threading

import torch.distributed as dist

dist.init_process_group("gloo")
started: list[int] = []
thread = threading.Thread(target=lambda: started.append(os.sched_getscheduler(0)))
thread.start()
thread.join()
child = subprocess.run([sys.executable, "-c", "import os; print(os.sched_getscheduler(0))"], capture_output=True,
                       text=True, check=True)
seen = {"threads": {tid: os.sched_getscheduler(int(tid)) for tid in os.listdir("/proc/self/task")},
        "started": started[0], "child": int(child.stdout)}
print("ddpd-test-env " + json.dumps(seen), flush=True)
dist.destroy_process_group()
