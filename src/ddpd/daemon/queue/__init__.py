"""The job queue.

Owns admission, job ids, dependencies, resources, retention, leftovers of a restart, job-state
decisions and the scheduler that starts attempts. Never imports the control socket.
"""
