"""Randomness for training steps: a context that switches random layers on.

    with random_context(seed=step_seed(run_seed, step)):
      logits = model(tokens)          # Dropout draws its masks here

Masks are a counter-based hash of (step seed, layer path, global element
index), so they do not depend on the layout, and a pipelined micro-batch draws
exactly the mask the same rows get in an unpipelined step.
"""

from __future__ import annotations

import contextlib
import math
from typing import Iterator, NamedTuple, Sequence

from layout_core.lazy import tf
from layout_core.layout.variables import flat_index, mix32
from layout_core.step_context import RandomState, current, entered


def current_random() -> RandomState | None:
  """The step context's random state; None outside a training step (evaluation)."""
  return current().random


@contextlib.contextmanager
def random_context(*, seed: tf.Tensor, batch_offset: 'int | tf.Tensor' = 0) -> Iterator[None]:
  """Turns on random layers (Dropout) for the code inside, e.g. a training step:
  the step context in force with `random` set (`layout_core.step_context`).

  `seed` is an int scalar tensor (the trainer gives run seed x step);
  `batch_offset` is the index of this micro-batch's first row in the global
  batch. Masks are a counter-based hash of (seed, layer path, global element
  index), so they do not depend on the layout, and a pipelined micro-batch
  draws exactly the mask the same rows get in an unpipelined step: distinct
  per micro-batch, deterministic, and identical when the backward pass
  re-computes a stage. Outside a context (evaluation) random layers are the
  identity.
  """
  with entered(current().replace(random=RandomState(seed, batch_offset))):
    yield


def step_seed(run_seed: int, step):
  """The seed of one training step (int64 tensor or Python int step)."""
  return step * 0x9E3779B1 + (run_seed & 0xFFFFFFFF)


class DropoutInputs(NamedTuple):
  """What a dropout mask is drawn from: the step seed, the layer's key (a hash
  of its path), and the global row index of the batch's first row. Scalars
  for a layer; one per slot (sequences) for stacked cells, where each slot
  holds another cell and micro-batch (a key of 0 for an idle slot)."""
  seed: 'tf.Tensor'
  keys: int | Sequence[int]
  first_rows: int | Sequence[int]


def dropout(x: 'tf.Tensor', *, rate: float, inputs: DropoutInputs, lead: str = ''):
  """Zeroes each element of x with probability `rate`, scaling the rest by
  1/(1-rate). With `lead` ('s'), x's leading dims are slots, each with its own
  key and first row. An element's mask bit hashes (seed, key, its global
  index), so it does not depend on the layout or on how the batch is split."""
  shape = tuple(x.shape.as_list())
  item = shape[len(lead):]                       # one slot's [batch, ...]
  row_size = math.prod(item[1:])
  key = tf.cast(inputs.seed, tf.int64) * 0x85EBCA77 + tf.constant(inputs.keys, tf.int64)
  key = mix32(tf.bitwise.bitwise_and(key, 0xFFFFFFFF))
  rows = inputs.first_rows  # ints, or a tensor (the sub-mesh engine's micro-steps)
  offset = (tf.cast(rows, tf.int64) if isinstance(rows, tf.Tensor)
            else tf.constant(rows, tf.int64)) * row_size
  index = flat_index(item)
  if lead:  # per-slot keys and offsets broadcast over each slot's elements
    per_slot = [-1] + [1] * len(item)
    index = tf.expand_dims(index, 0) + tf.reshape(offset, per_slot)
    key = tf.reshape(key, per_slot)
  else:
    index = index + offset
  bits = mix32(tf.bitwise.bitwise_and(index * 2 + key, 0xFFFFFFFF))
  keep = tf.cast(bits, tf.float32) >= rate * 4294967296.0
  return tf.where(keep, x / (1.0 - rate), tf.zeros_like(x))
