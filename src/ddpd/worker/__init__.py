"""The worker: one rank of one job attempt, run as ``python -m ddpd.worker --fd N --parent PID``.

It talks to the daemon only through the inherited channel (see ``ddpd.protocol.channel``) and
never imports ``ddpd.daemon``. Tasks plug in through ``ddpd.worker.tasks``; scripts may report
progress through ``ddpd.worker.api``.
"""
