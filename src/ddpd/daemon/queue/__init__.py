"""The job queue.

Owns the daemon's jobs as control sees them (`facade.Jobs`: find, page, submit, cancel, remove,
stacks, release_gpu, and `overview`, one frozen snapshot the views read), the queue's lifecycle that
app drives (`facade.JobQueue`: recover, run, reconfigure, shutdown, force_stop), the one live config
every part reads at each use (`live.LiveConfig`: no part keeps a copy), admission, job ids,
dependencies, resources, the scheduler (the queue and `decide.plan`: who starts, who
waits, whom to preempt), one `runner.JobRunner` per started job (its attempts and the job-state
decisions after them, `run.lifecycle`; told by `commands`), a job's end, recovery (leftovers of a
restart), retention and history, fair share, the GPU quarantine and notification hooks.

May import: protocol, config, layout, contain, store, pool, gpu, ranklogs, run, multinode, attempt.
Never imports: control, app, main.
"""
