"""A script that never calls init_process_group: prints its environment as one JSON line and exits 0.

torchrun reports such a run as a success; so does ddpd.
"""

import json
import os
import sys

print("ddpd-test-env " + json.dumps({"env": dict(os.environ), "argv": sys.argv, "cwd": os.getcwd()}), flush=True)
