"""The control socket's side of the daemon.

Owns the server and its door (connection limits), one handler per request type, request frames and
replies, follow streams, who may see what, interpreter checks (the check itself, as the submitter,
and its admission) and the metrics endpoint. It reaches the queue through `queue.facade` only (the
`Jobs` facade, its `Overview`, the live config), never a part of it (tests/unit/test_layers.py).

May import: protocol, config, layout, contain, store, pool, gpu, ranklogs, run, multinode, attempt, queue.
Never imports: app, main.
"""
