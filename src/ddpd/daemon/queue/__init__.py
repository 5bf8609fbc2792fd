"""The job queue.

Owns admission, job ids, dependencies, resources, retention, leftovers of a restart and the
scheduler that starts attempts and applies the job-state decisions (`run.lifecycle`) after them.

May import: protocol, config, layout, contain, store, pool, gpu, ranklogs, run, multinode, attempt.
Never imports: control, app, main.
"""
