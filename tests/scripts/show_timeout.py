"""A torchrun script that joins without a timeout of its own and prints the process group's timeout
(seconds) and DDPD_COLLECTIVE_TIMEOUT on its `ddpd-test-env` line."""

import json
import os

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
backend = dist.group.WORLD._get_backend(torch.device("cpu"))
seen = {"timeout": backend.options._timeout.total_seconds(), "env": os.environ.get("DDPD_COLLECTIVE_TIMEOUT")}
print("ddpd-test-env " + json.dumps(seen), flush=True)
dist.destroy_process_group()
