"""One attempt of a job.

Owns launching its ranks, their states and deadlines, teardown of the gang, stacks and the root
cause of its ending. Never imports the queue or the control socket.
"""
