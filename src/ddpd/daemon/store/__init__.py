"""Durable state: the SQLite journal, job records, the event bus and loss curves.

Never imports supervision, scheduling or the control socket.
"""
