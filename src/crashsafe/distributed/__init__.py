"""One process or many: how the processes of a CheckpointManager coordinate (one alone, every
exchange a no-op; or the ranks of a torch.distributed job), who writes which array, the one
``save_step`` and its commit, and shards restored into any number of ranks. See docs/distributed.md.

torch.distributed itself is imported only when a process group is in use.
"""
