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

Classes that are `tf.Module`s at run time (layers, the optimizer) but must be
defined at config time derive from `Module` instead: the class is plain
Python until its first instance is made, which is then an instance of a
subclass that also derives from `tf.Module`:

    class Dense(Module):
      def __init__(self):
        super().__init__(name='dense')   # tf.Module.__init__
    isinstance(Dense(), tf.Module)       # True
"""

from __future__ import annotations

import gc
import importlib
import sys
import types


# What import machinery, pickle, inspect and test collectors probe on modules.
_PROBED_NAMES = frozenset({'__path__', '__file__', '__all__', '__wrapped__', '__func__',
                           '__self__', '__getstate__', '__reduce__', '__reduce_ex__',
                           '__bases__', '__mro__', '__code__', '__signature__',
                           '__text_signature__', '__origin__', '__test__'})


def import_collector_paused(name: str) -> types.ModuleType:
  """`importlib.import_module(name)` with Python's cyclic garbage collector
  paused, then one full collection and the survivors frozen (`gc.freeze`).
  Importing TensorFlow leaves about 360,000 objects that live as long as the
  process; with the collector on, their number triggers 6 full collections
  during the import, each walking every object made so far, and every later
  full collection walks them again. `bench/import_gc.py` measures both. A
  module imported already is returned as it is."""
  if name in sys.modules:
    return importlib.import_module(name)
  enabled = gc.isenabled()
  gc.disable()
  try:
    module = importlib.import_module(name)
  finally:
    if enabled:
      gc.enable()
  gc.collect()  # the import's own garbage, which a frozen heap would keep
  gc.freeze()
  return module


class LazyModule(types.ModuleType):
  """A module proxy that imports `name` at the first attribute access."""

  def __init__(self, name: str):
    super().__init__(name)
    self._target = name
    self._module = None

  def _load(self) -> types.ModuleType:
    if self._module is None:
      self._module = import_collector_paused(self._target)
    return self._module

  def __getattr__(self, attribute: str):
    if attribute in _PROBED_NAMES:  # introspection must not import TensorFlow
      raise AttributeError(attribute)
    return getattr(self._load(), attribute)

  def __dir__(self):
    return dir(self._load())

  def __repr__(self) -> str:
    state = 'loaded' if self._module is not None else 'not loaded yet'
    return f'<lazy module {self._target!r} ({state})>'


tf = LazyModule('tensorflow')
dtensor = LazyModule('tensorflow.experimental.dtensor')


class Module:
  """A base that becomes `tf.Module` when the first instance is made.

  `SomeLayer(...)` builds an instance of `SomeLayer+tf.Module` (same name,
  made once per class), so `isinstance(x, SomeLayer)` and
  `isinstance(x, tf.Module)` both hold, attribute tracking and checkpoint keys
  are tf.Module's, and defining `SomeLayer` imports nothing.
  """

  _runtime_classes: dict[type, type] = {}

  def __new__(cls, *args, **kwargs):
    del args, kwargs
    runtime = Module._runtime_classes.get(cls)
    if runtime is None:
      if issubclass(cls, tf.Module):  # already a runtime class
        runtime = cls
      else:
        runtime = type(cls.__name__, (cls, tf.Module),
                       {'__module__': cls.__module__, '__qualname__': cls.__qualname__,
                        '__doc__': cls.__doc__})
      Module._runtime_classes[cls] = runtime
    return super().__new__(runtime)

