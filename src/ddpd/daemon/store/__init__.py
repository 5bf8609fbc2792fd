"""Durable state: the SQLite database and its journal (all SQL: the journal's writes and their group
commit, its reads, the rows' shapes), job records and their errors, the event bus, loss curves, the
budget of what one rank may persist (eventbudget), and the modes of the daemon's own files: its
umask, the database root's alone (private).

May import: protocol, config, layout.
Never imports: contain, pool, gpu, ranklogs, run, multinode, attempt, queue, control, app, main.
"""
