"""The control socket's side of the daemon.

Owns the server, request parsing and replies, follow streams, who may see what, interpreter
checks and the metrics endpoint. Never imported by the queue, an attempt, the pool or storage.
"""
