"""One attempt of a job.

Owns launching its ranks (cold or from the pool), their states and deadlines, teardown of the
gang, and stacks.

May import: protocol, config, layout, contain, store, pool, gpu, ranklogs, run, multinode.
Never imports: queue, control, app, main.
"""
