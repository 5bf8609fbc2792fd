"""A torchrun script that leaves an escapee behind: double-forked, in a new session, with an empty
environment (no attempt marker), so that only the attempt's cgroup still knows it. Prints its pid;
with `--hang`, then waits for ever."""

import os
import sys
import time

import torch.distributed as dist

r, w = os.pipe()
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        os.close(r)
        os.write(w, str(os.getpid()).encode())
        os.close(w)
        os.execve("/bin/sleep", ["sleep", "600"], {})
    os._exit(0)
os.close(w)
escapee = int(os.read(r, 64))
os.wait()
print(f"ESCAPEE {escapee}", flush=True)
dist.init_process_group("gloo")
dist.destroy_process_group()
if "--hang" in sys.argv:
    print("HANGING", flush=True)
    while True:
        time.sleep(3600)
