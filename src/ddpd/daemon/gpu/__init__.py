"""GPU discovery, placement figures and the per-GPU view from NVML.

Never imports an attempt, the queue or the control socket.
"""
