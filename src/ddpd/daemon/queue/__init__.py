"""The job queue.

Owns admission, job ids, dependencies, resources, retention, leftovers of a restart, job-state
decisions and the scheduler that starts attempts.

May import: protocol, config, layout, contain, store, pool, gpu, ranklogs, run, multinode, attempt.
Never imports: control, app, main.
"""
