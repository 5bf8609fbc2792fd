"""One attempt of a job.

Owns launching its ranks (cold or from the pool), their states and deadlines, hot replacement,
teardown of the gang, and stacks. Its control flow is one loop (`loop.Supervisor`): every task of
the attempt (a rank's reader and exit watch, the launch, a re-form, the node watch, the teardown)
sends typed events (`events`) upward on one stream, and the loop decides on each in one `match`;
no task calls back into the attempt, and only the loop starts tasks into the attempt's task group.

May import: protocol, config, layout, contain, store, pool, gpu, ranklogs, run, multinode.
Never imports: queue, control, app, main.
"""
