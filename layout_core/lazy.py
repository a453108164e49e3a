"""TensorFlow, imported on first use, so a config can be checked without it.

`import tensorflow` takes 3-6 s; a typo in a .gin file should be reported
before that. Modules that the config path imports (params, rules, layers'
declarations, the config dataclasses) write

    from layout_core.lazy import tf, dtensor

and touch `tf.` only inside functions: the real import happens at the first
attribute access, after the config has been validated.

    import sys
    from layout_core.lazy import tf
    'tensorflow' in sys.modules   # False
    tf.constant(1)                # imports TensorFlow now
"""

from __future__ import annotations

import importlib
import types


class LazyModule(types.ModuleType):
  """A module proxy that imports `name` at the first attribute access."""

  def __init__(self, name: str):
    super().__init__(name)
    self._target = name
    self._module = None

  def _load(self) -> types.ModuleType:
    if self._module is None:
      self._module = importlib.import_module(self._target)
    return self._module

  def __getattr__(self, attribute: str):
    if attribute.startswith('__') and attribute.endswith('__'):
      raise AttributeError(attribute)
    return getattr(self._load(), attribute)

  def __dir__(self):
    return dir(self._load())

  def __repr__(self) -> str:
    state = 'loaded' if self._module is not None else 'not loaded yet'
    return f'<lazy module {self._target!r} ({state})>'


tf = LazyModule('tensorflow')
dtensor = LazyModule('tensorflow.experimental.dtensor')


def tensorflow_loaded() -> bool:
  """True once TensorFlow has been imported (by us or anyone else)."""
  import sys  # pylint: disable=g-import-not-at-top
  return 'tensorflow' in sys.modules
