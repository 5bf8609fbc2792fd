"""The warm pool of pre-started worker interpreters, their keys and environments, and the channel
each worker speaks.

May import: protocol, config, layout, contain.
Never imports: store, gpu, ranklogs, run, multinode, attempt, queue, control, app, main.
"""
