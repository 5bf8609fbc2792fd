"""The job queue.

Owns the daemon's jobs as control and app see them (`facade.Jobs`, their one surface), admission,
job ids, dependencies, resources, the scheduler (the queue and `decide.plan`: who starts, who
waits, whom to preempt), one `runner.JobRunner` per started job (its attempts and the job-state
decisions after them, `run.lifecycle`; told by `commands`), a job's end, recovery (leftovers of a
restart), retention and history, fair share, the GPU quarantine and notification hooks.

May import: protocol, config, layout, contain, store, pool, gpu, ranklogs, run, multinode, attempt.
Never imports: control, app, main.
"""
