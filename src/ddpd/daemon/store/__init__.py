"""Durable state: the SQLite database and its journal (all SQL), job records and their errors, the
event bus, loss curves, and the budget of what one rank may persist (eventbudget).

May import: protocol, config, layout.
Never imports: contain, pool, gpu, ranklogs, run, multinode, attempt, queue, control, app, main.
"""
