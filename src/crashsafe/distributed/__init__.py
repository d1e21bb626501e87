"""Many processes, one checkpoint: the collective side of CheckpointManager on torch.distributed.

Nothing here is imported unless a manager runs on a process group (``import crashsafe`` stays free
of torch.distributed). See docs/distributed.md.
"""
