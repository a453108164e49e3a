"""Randomness for training steps: a context that switches random layers on.

    with random_context(seed=step_seed(run_seed, step)):
      logits = model(tokens)          # Dropout draws its masks here

Masks are a counter-based hash of (step seed, layer path, global element
index), so they do not depend on the layout, and a pipelined micro-batch draws
exactly the mask the same rows get in an unpipelined step.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Iterator, NamedTuple

from layout_core.lazy import tf

_state = threading.local()


class RandomState(NamedTuple):
  seed: 'tf.Tensor'     # int64 scalar: the step's seed
  batch_offset: int     # the global row index of this micro-batch's first row


def current_random() -> RandomState | None:
  """The innermost `random_context`'s state; None outside one (evaluation)."""
  return getattr(_state, 'value', None)


@contextlib.contextmanager
def random_context(*, seed: tf.Tensor, batch_offset: int = 0) -> Iterator[None]:
  """Turns on random layers (Dropout) for the code inside, e.g. a training step.

  `seed` is an int scalar tensor (the trainer gives run seed x step);
  `batch_offset` is the index of this micro-batch's first row in the global
  batch. Masks are a counter-based hash of (seed, layer path, global element
  index), so they do not depend on the layout, and a pipelined micro-batch
  draws exactly the mask the same rows get in an unpipelined step: distinct
  per micro-batch, deterministic, and identical when the backward pass
  re-computes a stage. Outside a context (evaluation) random layers are the
  identity.
  """
  previous = current_random()
  _state.value = RandomState(seed, batch_offset)
  try:
    yield
  finally:
    _state.value = previous


def step_seed(run_seed: int, step):
  """The seed of one training step (int64 tensor or Python int step)."""
  return step * 0x9E3779B1 + (run_seed & 0xFFFFFFFF)
