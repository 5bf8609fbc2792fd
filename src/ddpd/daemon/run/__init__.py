"""What one run of ranks needs below the attempt and the multi-node session that share it.

Owns the clock that deadlines and teardown read (real or fake), the rendezvous port the ranks meet
on, an attempt's outcome and the root cause among its ranks' failures, and every job-state
decision (lifecycle, pure), which the attempt and the scheduler both apply.

May import: protocol, config, layout, contain, pool.
Never imports: store, gpu, ranklogs, multinode, attempt, queue, control, app, main.
"""
