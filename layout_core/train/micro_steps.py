"""Equal parts of a batch: gradient accumulation, the mean of equal parts,
and the rows of them a client holds; written once for every engine.

    steps = MicroSteps(count=4, batch_size=32)          # train.grad_accum_steps = 4
    packed = steps.pack(batch, pack_one=program.pack)    # 4 packs of 8 rows each
    loss, metrics, grads = steps.gradients(packed, micro_step)   # micro_step(part, first_row)
    loss, metrics = steps.evaluate(packed, evaluate_one)

A batch cut into k equal parts has as its mean (loss, metrics, gradients)
the sum of each part's mean / k: `share` is that division; `add_share` adds
the shares as the parts come (accumulation keeps only the running total
alive), `sum_shares` adds a list of them at once, one AddN per leaf, as the
pipeline engines do for their micro-batches (`layout_core.pipeline.submesh.GPipe`,
`SpmdProgram`). Both add in the parts' order; they are not interchanged,
because the graph around a sum changes how Grappler rewrites a step
function: GPipe's backward function with a chain of adds instead of its
AddN gave bias gradients that differ in the last bit.

With one micro-step (k = 1) nothing is cut, divided or added: the engine's
own function runs on the whole batch, exactly as without accumulation.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from layout_core.lazy import tf
from layout_core.layout import mesh as mesh_lib


def share(result, parts: int):
  """`result` / `parts`, leaf by leaf: one of `parts` equal parts' share of
  their mean (a loss, a {metric: value} dict, a list of gradients, ...)."""
  return tf.nest.map_structure(lambda value: value / parts, result)


def add_share(total, part_share):
  """`total` (None before the first part) + `part_share`, leaf by leaf: the
  shares of all parts, added in order, are their mean."""
  if total is None:
    return part_share
  return tf.nest.map_structure(lambda a, b: a + b, total, part_share)


def sum_shares(shares: Sequence):
  """The sum of `shares` (each a `share`, all of one structure), leaf by
  leaf, in one AddN per leaf: the mean of the parts they came from."""
  return tf.nest.map_structure(lambda *values: tf.add_n(list(values)), *shares)


def split_rows(batch: Mapping[str, np.ndarray], parts: int) -> list[dict]:
  """A host batch {name: [B, ...]} as `parts` batches {name: [B/parts, ...]}."""
  pieces = {name: np.split(value, parts) for name, value in batch.items()}
  return [{name: split[i] for name, split in pieces.items()} for i in range(parts)]


@dataclasses.dataclass(frozen=True)
class MicroSteps:
  """`count` micro-steps of `batch_size / count` consecutive rows each, added
  up as one optimizer step (`train.grad_accum_steps`)."""
  count: int
  batch_size: int

  @property
  def rows(self) -> int:
    """Rows per micro-step."""
    return self.batch_size // self.count

  def pack(self, batch: Mapping[str, np.ndarray], pack_one: Callable[[Mapping], Any]):
    """`pack_one(batch)`; with several micro-steps, a list of `pack_one` of each part."""
    if self.count == 1:
      return pack_one(batch)
    return [pack_one(part) for part in split_rows(batch, self.count)]

  def gradients(self, packed, micro_step: Callable[[Any, int], tuple], *,
                one_at_a_time: bool = False):
    """(loss, metrics, gradients) of the whole batch from `micro_step(part,
    first_row)`, which returns those three for one packed part whose first
    row is the batch's row `first_row` (dropout masks follow the rows).

    `one_at_a_time` (inside a tf.function): each micro-step starts after the
    gradients summed so far exist, so only one micro-step's activations are
    alive at a time (on the host, calls run in order anyway)."""
    if self.count == 1:
      return micro_step(packed, 0)
    total = None
    for i, part in enumerate(packed):
      if one_at_a_time and total is not None:
        with tf.control_dependencies(tf.nest.flatten(total[2])):
          part = tf.nest.map_structure(tf.identity, part)
      total = add_share(total, share(micro_step(part, i * self.rows), self.count))
    return total

  def evaluate(self, packed, evaluate_one: Callable[[Any], tuple]):
    """(loss, metrics) of the whole batch from `evaluate_one(part)`."""
    if self.count == 1:
      return evaluate_one(packed)
    total = None
    for part in packed:
      total = add_share(total, share(evaluate_one(part), self.count))
    return total


def client_rows(mesh, *, batch_axis: str, batch_size: int,
                parts: int = 1) -> np.ndarray | None:
  """The rows of a global batch that this client's devices hold, when the
  batch is cut into `parts` equal consecutive parts (micro-steps times
  micro-batches), each split over `batch_axis`. None when this client holds
  every row: it holds every device, or the batch is replicated (no batch axis)."""
  axes = mesh_lib.mesh_axes(mesh)
  if len(mesh.local_devices()) == mesh.size or batch_axis not in axes:
    return None
  per_part = batch_size // parts
  shard = per_part // axes[batch_axis]
  held = sorted({location[batch_axis] for location in mesh.local_device_locations()})
  return np.array([part * per_part + index * shard + row for part in range(parts)
                   for index in held for row in range(shard)], np.int64)

