"""Side-by-side benchmarks of ddpd, torchrun and torch.multiprocessing.spawn (``python -m benchmarks``).

Modules: ``launch`` (launch and end to end of the classic job), ``detect`` (a rank SIGKILLed),
``throughput`` (steady-state steps/s and the daemon's cost while supervising), ``scale`` (the
daemon with hundreds of simulated workers); ``ddp_script`` is the standalone program torchrun and
mp.spawn run, ``simworker.sh`` the torch-free worker of the scale benchmark.
"""
