"""The ddpd daemon: control server, scheduler, job supervisors, rendezvous and state."""
