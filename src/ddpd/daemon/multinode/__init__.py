"""Multi-node jobs: torch's elastic rendezvous, node records and the watch on other nodes.

Never imports the queue or the control socket.
"""
