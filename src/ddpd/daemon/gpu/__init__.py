"""GPU discovery (NVML), placement figures, the per-GPU view, and the draining of GPUs a gone job's
ranks may still hold.

May import: protocol, config, layout, contain, store.
Never imports: pool, ranklogs, run, multinode, attempt, queue, control, app, main.
"""
