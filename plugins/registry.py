"""Making a user's own layers, tasks and Keras models available to gin.

In the user's module (any importable package, e.g. `my_project/layers.py`):

    from layout_core.model.base import BaseLayer, Declared, LayerMeta
    from plugins.registry import register_layer

    @register_layer                       # gin: @gated_dense() -> its Params
    class GatedDense(BaseLayer):
      ...

and in the .gin file (the package must be importable: on PYTHONPATH, or in a
directory given with --gin_search_paths, which launchers also put on sys.path):

    import my_project.layers
    model.params = @sequential()
    sequential.sub = [@gated_dense(), @softmax()]
    gated_dense.output_dim = 32

`register_layer(cls)` registers a function named after the class in
snake_case whose keyword arguments are exactly the class's Params keys, so gin
reports a misspelt key with the list of real ones, and which returns
`cls.Params().Set(...)`. `register_task` and `register_keras_model` register a
Task class / a function returning a keras.Model under the same naming. Every
name is registered in the user's own gin module (the Python module name) so
it can always be spelt fully: `@my_project.layers.gated_dense()`.
"""

from __future__ import annotations

import inspect
import re
from typing import Any, Callable

import gin

from layout_core.params import Params


def snake_case(name: str) -> str:
  """The gin name the registry gives a class: 'GatedDense' -> 'gated_dense',
  'MLPBlock' -> 'mlp_block'."""
  name = re.sub(r'([A-Z]+)([A-Z][a-z])', r'\1_\2', name)
  return re.sub(r'([a-z0-9])([A-Z])', r'\1_\2', name).lower()


def _params_builder(cls: type, name: str) -> Callable[..., Params]:
  """A function `name(**params keys) -> cls.Params().Set(...)` with a real
  signature (gin validates parameter names against it)."""
  defaults = cls.Params()
  # Not `cls`, nor `tuning`, which the run's lora.* and train.trainable set.
  keys = [key for key, _ in defaults.IterParams() if key not in ('cls', 'tuning')]
  unset = object()

  def build(**kwargs: Any) -> Params:
    p = cls.Params()
    p.Set(**{k: v for k, v in kwargs.items() if v is not unset})
    return p

  build.__signature__ = inspect.Signature([
      inspect.Parameter(key, inspect.Parameter.KEYWORD_ONLY, default=unset)
      for key in keys])
  build.__name__ = build.__qualname__ = name
  build.__doc__ = f'Params of {cls.__module__}.{cls.__qualname__} (keys: {", ".join(keys)}).'
  build.__module__ = cls.__module__
  return build


def register_layer(cls: type | None = None, *, name: str | None = None,
                   module: str | None = None):
  """Makes a `BaseLayer` subclass configurable in gin as its Params.

  A decorator, bare or with arguments. It registers a function named after
  the class in snake_case whose keyword arguments are exactly the class's
  Params keys (but `cls` and `tuning`), so gin reports a misspelt key with the real ones;
  `@gated_dense()` in gin then returns `GatedDense.Params()` with the bound
  keys set. The class itself is returned unchanged.

      @register_layer                       # gin: @gated_dense()
      class GatedDense(BaseLayer):
        ...

      @register_layer(name='gate')          # gin: @gate(), @my_project.layers.gate()
      class GatedDense(BaseLayer):
        ...

  Args:
    cls: The layer class (given when used as a bare decorator).
    name: The gin name; default: the class name in snake_case
      (`snake_case`).
    module: The gin module the name is registered in; default: the class's
      Python module, so `@my_project.layers.gated_dense()` always works.

  Returns:
    The class unchanged, or (called with only `name` / `module`) a decorator
    that registers its class.
  """
  def register(layer_cls: type) -> type:
    configurable_name = name or snake_case(layer_cls.__name__)
    gin.external_configurable(_params_builder(layer_cls, configurable_name),
                              name=configurable_name,
                              module=module or layer_cls.__module__)
    return layer_cls
  return register(cls) if cls is not None else register


def register_task(cls: type | None = None, *, name: str | None = None,
                  module: str | None = None):
  """Makes a `Task` subclass a gin configurable, for `data.task = @name()`.

  The constructor's keyword arguments become bindable gin parameters
  (`centroid_task.noise = 0.5`).

      @register_task                        # gin: data.task = @centroid_task()
      class CentroidTask(Task):
        def __init__(self, *, dim: int = 8, noise: float = 0.8):
          ...

  Args:
    cls: The task class (given when used as a bare decorator).
    name: The gin name; default: the class name in snake_case.
    module: The gin module the name is registered in; default: the class's
      Python module.

  Returns:
    The class unchanged, or (called with only `name` / `module`) a decorator
    that registers its class.
  """
  def register(task_cls: type) -> type:
    gin.external_configurable(task_cls, name=name or snake_case(task_cls.__name__),
                              module=module or task_cls.__module__)
    return task_cls
  return register(cls) if cls is not None else register


def register_keras_model(fn: Callable | None = None, *, name: str | None = None,
                         module: str | None = None):
  """Makes a function returning a `keras.Model` a gin configurable.

  Bind it without parentheses, `keras_model.build_fn = @my_model`: gin
  passes the function and meshgin calls it inside its layout scope, so every
  weight is born with its layout. Its keyword arguments are bindable
  (`my_model.hidden = 64`).

      keras = import_keras()                # layout_core.model.keras

      @register_keras_model                 # gin: keras_model.build_fn = @my_model
      def my_model(hidden: int = 32):
        inputs = keras.Input((8,))
        x = keras.layers.Dense(hidden, activation='relu', name='hidden')(inputs)
        return keras.Model(inputs, keras.layers.Dense(4, name='logits')(x))

  Args:
    fn: The model function (given when used as a bare decorator).
    name: The gin name; default: the function's own name.
    module: The gin module the name is registered in; default: the
      function's Python module.

  Returns:
    The gin configurable wrapping `fn` (call it as `fn`), or (called with only
    `name` / `module`) a decorator that registers its function.
  """
  def register(model_fn: Callable) -> Callable:
    return gin.configurable(name or model_fn.__name__,
                            module=module or model_fn.__module__)(model_fn)
  return register(fn) if fn is not None else register
