"""All-gathers of many tensors in a few collectives.

Sharded optimizer state ends each step with one all-gather per parameter:
every parameter's updated shards back to the replicated parameter. DTensor
emits one collective for each, and on a one-axis mesh each costs more in
the devices meeting than in the bytes they move, so `gather_together` lays
the shards side by side in buckets and gathers each bucket once (the
sharded-state step it serves is timed by `bench/step.py`; no bench times
the bucketing alone):

    values = gather_together(shards, layouts, targets)   # == [relayout(s, t) ...]

A shard joins a bucket when its target is replicated and it is split on one
dimension by one axis: its local piece, that dimension first, is then a row
of a `[axis size, n]` tensor split by rows, which is laid beside the other
shards' rows (no data moves) and gathered with them. Anything else is relaid
on its own. A bucket holds at most `bucket_bytes` of gathered values, so the
gathered copies alive at once stay bounded as the model grows.
"""

from __future__ import annotations

from typing import Sequence

from layout_core.lazy import dtensor, tf
from layout_core.layout.rules import UNSHARDED

BUCKET_BYTES = 32 * 2**20


def _split_dim(layout, target) -> int | None:
  """The one dimension `layout` splits that `target` (replicated) does not;
  None when the pair is not that simple case."""
  if any(spec != UNSHARDED for spec in target.sharding_specs):
    return None
  split = [i for i, spec in enumerate(layout.sharding_specs) if spec != UNSHARDED]
  return split[0] if len(split) == 1 else None


def _rows(value, dim: int, parts: int):
  """`value` (split on `dim` into `parts`) as `[parts, n]`, split by rows:
  the split dimension moved first, then flattened; a local reshape."""
  if dim:
    value = tf.transpose(value, [dim] + [i for i in range(value.shape.rank) if i != dim])
  return tf.reshape(value, [parts, -1])


def _unrows(rows, shape: Sequence[int], dim: int):
  """Inverse of `_rows` for a replicated `[parts, n]`."""
  moved = [shape[dim]] + [n for i, n in enumerate(shape) if i != dim]
  value = tf.reshape(rows, moved)
  if dim:
    order = list(range(1, dim + 1)) + [0] + list(range(dim + 1, len(shape)))
    value = tf.transpose(value, order)
  return value


def gather_together(values: Sequence[tf.Tensor], layouts: Sequence, targets: Sequence, *,
                    bucket_bytes: int = BUCKET_BYTES) -> list[tf.Tensor]:
  """`[dtensor.relayout(v, t) for v, t in zip(values, targets)]` for values
  in `layouts`, the simple all-gathers (module docstring) done a bucket at a
  time. Call inside a `tf.function` (where layouts cannot be fetched)."""
  values, out = list(values), [None] * len(values)
  buckets: dict[tuple, list[list[tuple[int, int]]]] = {}  # key -> buckets of (index, dim)
  sizes: dict[tuple, int] = {}
  for i, (value, layout, target) in enumerate(zip(values, layouts, targets)):
    value = values[i] = dtensor.relayout(value, layout)
    dim = _split_dim(layout, target) if layout.mesh == target.mesh else None
    if dim is None:
      out[i] = dtensor.relayout(value, target)
      continue
    key = (target.mesh.to_string(), layout.sharding_specs[dim], value.dtype)
    nbytes = value.shape.num_elements() * value.dtype.size
    if key not in buckets or sizes[key] + nbytes > bucket_bytes:
      buckets.setdefault(key, []).append([])
      sizes[key] = 0
    buckets[key][-1].append((i, dim))
    sizes[key] += nbytes
  for (_, axis, _), groups in buckets.items():
    for group in groups:
      mesh = targets[group[0][0]].mesh
      parts = dict(zip(mesh.dim_names, mesh.shape()))[axis]
      rows = [_rows(values[i], dim, parts) for i, dim in group]
      gathered = dtensor.relayout(rows[0] if len(rows) == 1 else tf.concat(rows, axis=1),
                                  dtensor.Layout.replicated(mesh, 2))
      start = 0
      for (i, dim), row in zip(group, rows):
        width = row.shape[1]
        out[i] = _unrows(gathered[:, start:start + width], values[i].shape.as_list(), dim)
        start += width
  return out
