"""A value set for the length of a `with` block, per thread.

The model reads a few things deep inside a call that nobody passes down:
the step's dropout seed, packed documents' segments, the residual stream's
split, FSDP's batch split, whether the layer runs rematerialized, the
variable creator. Each is a `Scoped`:

    _seed = Scoped()
    with _seed.set(7):
      _seed.get()        # 7
    _seed.get()          # None again (the default)

Blocks nest: leaving one restores the value the enclosing block set.
Importing this module does not import TensorFlow.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterator


class Scoped:
  """One value per thread, set by `with scoped.set(value):`; `default` outside."""

  def __init__(self, default: Any = None):
    self._default = default
    self._local = threading.local()

  def get(self) -> Any:
    return getattr(self._local, 'value', self._default)

  @contextlib.contextmanager
  def set(self, value: Any) -> Iterator[None]:
    previous = self.get()
    self._local.value = value
    try:
      yield
    finally:
      self._local.value = previous
