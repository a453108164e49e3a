"""Sharded DTensor checkpoints: `manager.Checkpointer` (atomic saves, resume,
init_from) on top of `shard_io` (each device writes and reads its own slices),
`files` (the directory on disk: manifests, checksums, validation), `damage`
(what counts as a damaged checkpoint), `state_file` (TF's `checkpoint` file),
`matching` (checkpoint keys vs model variables) and `lock` (one writer per
model_dir)."""
