"""Rank log files: the index, reading, seeking, rotation, each attempt's log streams and their
keeper (which reads a live rank through a Protocol, never the attempt's handle).

May import: protocol, config, layout, contain, store.
Never imports: pool, gpu, run, multinode, attempt, queue, control, app, main.
"""
