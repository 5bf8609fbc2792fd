"""Multi-node jobs: torch's elastic rendezvous (served by an agent of the job's user), node records
and the watch on other nodes.

May import: protocol, config, layout, contain, store, pool, run.
Never imports: gpu, ranklogs, attempt, queue, control, app, main.
"""
