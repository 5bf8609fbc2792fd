"""Durable state: the SQLite database and its journal (all SQL), job records and their errors, the
event bus, loss curves.

May import: protocol, config, layout.
Never imports: contain, pool, gpu, ranklogs, run, multinode, attempt, queue, control, app, main.
"""
