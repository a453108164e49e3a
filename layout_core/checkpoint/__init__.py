"""Sharded DTensor checkpoints: `manager.Checkpointer` (atomic saves, resume,
damage handling, init_from) on top of `shard_io` (each device writes and reads
its own slices)."""
