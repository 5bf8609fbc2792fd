"""The ddpd daemon: the process root (app, main, config, logs, notify) and one subpackage per seam.

The subpackages form layers; each imports only those below it, as its `__init__` states in two
lines (`May import:` and `Never imports:`, checked by tests/unit/test_layers.py), from the bottom:

    contain, store        the OS side of containment; durable state
    pool, gpu, ranklogs   warm interpreters; GPUs; rank log files
    run                   what an attempt and a multi-node session share
    multinode             the nodes of a multi-node job
    attempt               one attempt of a job
    queue                 the queue and the scheduler
    control               the control socket and the metrics endpoint

Below them all: `protocol` and the root's `config` (with `logs`, `logline`, `journald`) and
`layout` (the state directory's names); above them: `app` and `main`, which may import anything.
"""
