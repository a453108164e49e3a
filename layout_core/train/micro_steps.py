"""Equal parts of a batch: gradient accumulation, and the rows of them a
client holds; written once for every engine.

    steps = MicroSteps(count=4, batch_size=32)          # train.grad_accum_steps = 4
    packed = steps.pack(batch, pack_one=program.pack)    # 4 packs of 8 rows each
    loss, metrics, grads = steps.gradients(packed, micro_step)   # micro_step(part, first_row)
    sums = steps.evaluate(packed, evaluate_one)

The parts of a batch add their sums (`layout_core.tasks.objective`): each
part's loss total and its count of trained tokens, its metrics' totals and
counts; the mean is taken once, over the whole batch. A micro-step
differentiates its part's total (`target`), the gradients of the parts are
added as they come (only the running total stays alive), and the sum is
divided once by the batch's count. So the loss and its gradients do not
depend on how the batch is cut, even where the parts hold different numbers
of trained tokens (response-only masks, packed padding), as with a mean of
per-part means they would. The pipeline engines add their micro-batches the
same way (`layout_core.pipeline.submesh.GPipe`, `SpmdProgram`).

With one micro-step (k = 1) nothing is cut or added: the engine's own
function differentiates the whole batch's loss, exactly as without
accumulation.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping

import numpy as np

from layout_core.lazy import tf
from layout_core.layout import mesh as mesh_lib
from layout_core.tasks.objective import (Mean, add_parts, denominator, finish,
                                         gradient_divisor, total_of, value_of)


def divide_gradients(gradients, count):
  """Each gradient / `count` (a scalar on the gradients' mesh; at least 1:
  a batch with nothing to train has gradients 0, not NaN)."""
  divisor = denominator(count)
  return tf.nest.map_structure(lambda g: g / divisor, gradients)


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

  def target(self, loss):
    """What a micro-step differentiates: the whole batch's loss with one
    micro-step; with several, its part's total (the sum of the parts'
    gradients is divided once, by the batch's count: `gradients`), or a
    plain mean itself (its gradients weighted 1/k as they come)."""
    return value_of(loss) if self.count == 1 else total_of(loss)

  def summed_gradients(self, packed, micro_step: Callable[[Any, int], tuple], *,
                       one_at_a_time: bool = False):
    """((loss, metrics) sums, gradients) added over the micro-steps, from
    `micro_step(part, first_row)`, which returns those two for one packed
    part whose first row is the batch's row `first_row` (dropout masks
    follow the rows), its gradients those of `target(loss)`.

    `one_at_a_time` (inside a tf.function): each micro-step starts after the
    gradients summed so far exist, so only one micro-step's activations are
    alive at a time (on the host, calls run in order anyway)."""
    if self.count == 1:
      return micro_step(packed, 0)
    parts, total = [], None
    for i, part in enumerate(packed):
      if one_at_a_time and total is not None:
        with tf.control_dependencies(tf.nest.flatten(total)):
          part = tf.nest.map_structure(tf.identity, part)
      sums, grads = micro_step(part, i * self.rows)
      if not isinstance(sums[0], Mean):  # a plain mean: its weight, 1/k, is known now
        grads = tf.nest.map_structure(lambda g: g / self.count, grads)
      parts.append(sums)
      total = grads if total is None else tf.nest.map_structure(lambda a, b: a + b,
                                                                total, grads)
    return add_parts(parts), total

  def gradients(self, packed, micro_step: Callable[[Any, int], tuple], *,
                one_at_a_time: bool = False,
                divide: Callable[[Any, Any], Any] = divide_gradients):
    """(loss, metrics, gradients) of the whole batch (`summed_gradients`,
    then the one division by the batch's count: `divide(gradients, count)`,
    the count living with the loss)."""
    sums, grads = self.summed_gradients(packed, micro_step, one_at_a_time=one_at_a_time)
    divisor = gradient_divisor(sums[0]) if self.count > 1 else None
    if divisor is not None:
      grads = divide(grads, divisor)
    loss, metrics = finish(sums)
    return loss, metrics, grads

  def evaluate(self, packed, evaluate_one: Callable[[Any], tuple]):
    """The (loss, metrics) sums of the whole batch from `evaluate_one(part)`
    (`layout_core.tasks.objective`; `finish` gives the numbers)."""
    if self.count == 1:
      return evaluate_one(packed)
    return add_parts([evaluate_one(part) for part in packed])


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

