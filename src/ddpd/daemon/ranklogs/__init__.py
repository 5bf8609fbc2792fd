"""Rank log files: the index, reading, seeking, rotation and each attempt's log streams.

Never imports the queue or the control socket.
"""
