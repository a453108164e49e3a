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
    sequential.layers = [@gated_dense(), @softmax()]
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
  """'GatedDense' -> 'gated_dense', 'MLPBlock' -> 'mlp_block'."""
  name = re.sub(r'([A-Z]+)([A-Z][a-z])', r'\1_\2', name)
  return re.sub(r'([a-z0-9])([A-Z])', r'\1_\2', name).lower()


def _params_builder(cls: type, name: str) -> Callable[..., Params]:
  """A function `name(**params keys) -> cls.Params().Set(...)` with a real
  signature (gin validates parameter names against it)."""
  defaults = cls.Params()
  keys = [key for key, _ in defaults.IterParams() if key != 'cls']
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
  """Class decorator (or call): `@name()` in gin returns `cls.Params()` with
  the bound keys set. Returns the class unchanged."""
  def register(layer_cls: type) -> type:
    configurable_name = name or snake_case(layer_cls.__name__)
    gin.external_configurable(_params_builder(layer_cls, configurable_name),
                              name=configurable_name,
                              module=module or layer_cls.__module__)
    return layer_cls
  return register(cls) if cls is not None else register


def register_task(cls: type | None = None, *, name: str | None = None,
                  module: str | None = None):
  """Class decorator: the Task class becomes a gin configurable (its
  constructor's keyword arguments are bindable). Returns the class unchanged."""
  def register(task_cls: type) -> type:
    gin.external_configurable(task_cls, name=name or snake_case(task_cls.__name__),
                              module=module or task_cls.__module__)
    return task_cls
  return register(cls) if cls is not None else register


def register_keras_model(fn: Callable | None = None, *, name: str | None = None,
                         module: str | None = None):
  """Function decorator: a function returning a keras.Model becomes a gin
  configurable, for `keras_model.build_fn = @my_model` (no parentheses: gin
  passes the function, meshgin calls it in the layout scope). Its keyword
  arguments are bindable (`my_model.hidden_dim = 64`)."""
  def register(model_fn: Callable) -> Callable:
    return gin.configurable(name or model_fn.__name__,
                            module=module or model_fn.__module__)(model_fn)
  return register(fn) if fn is not None else register
