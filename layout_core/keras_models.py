"""Keras 3 models (TensorFlow backend), model-parallel with meshgin's layout rules.

Keras 3's own model parallelism (`keras.distribution`) is JAX-only, and
`tf.keras.dtensor` went away with Keras 2. meshgin builds the user's Keras
model inside a `tf.variable_creator_scope` that creates every weight directly
as a DVariable with the layout its rule gives, and then trains it with its own
loop and Adam (slots take each weight's layout), so checkpoints, resume,
reshard, the layout table and TensorBoard work as for Params models.

    def make_classifier(num_classes=4):                   # the user's own code
      inputs = keras.Input((16,))
      x = keras.layers.Dense(64, activation='relu', name='hidden')(inputs)
      return keras.Model(inputs, keras.layers.Dense(num_classes, name='logits')(x))

    model = KerasModel(build_fn=make_classifier)
    built = build(model, mesh=mesh, rules=LayoutRules([(r'hidden/kernel', ('unsharded', 'model'))]),
                  seed=0, example_inputs=(x,))
    built.variables['hidden/kernel'].layout           # sharded over 'model'

Paths: a weight's path is its Keras `variable.path` (`<layer name>/<weight
name>`, e.g. `hidden/kernel`; layers nested in a subclassed layer or model add
their names: `block/dense/kernel`). Rules match these paths, the layout table
lists them and checkpoints key the weights by them. Keras' automatic layer
names (`dense`, `dense_1`) count per session, so `build` clears Keras' session
first; name your layers to keep paths stable when the model changes.

Initial values: Keras' initializers run once on the host, unsharded, seeded
with `keras.utils.set_random_seed(seed)` before the model is built (so they do
not depend on the layout, unlike stateless random ops run per shard), and each
device receives only its slice. The price: each weight exists once in full on
the host while it is created. `plan` lists the weights without allocating
any of them (Keras' stateless scope defers initialisation), which is what
`launch.inspect` shows for a Keras model.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable, Mapping, Sequence

from layout_core import mesh as mesh_lib
from layout_core.errors import ConfigError
from layout_core.layout_scope import LayoutRecord, plan_layouts
from layout_core.lazy import dtensor, tf
from layout_core.rules import LayoutRules
from layout_core.variables import VariableSpec, creator_initial_value


@dataclasses.dataclass(frozen=True)
class KerasModel:
  """A Keras 3 model to train: `build_fn()` returns a `keras.Model` (or Layer)."""
  build_fn: Callable[[], Any]
  name: str = 'keras_model'

  def describe(self) -> str:
    target = getattr(self.build_fn, '__wrapped__', self.build_fn)
    return (f'Keras model from {getattr(target, "__module__", "?")}.'
            f'{getattr(target, "__qualname__", repr(target))}')


def import_keras():
  """Keras 3 with the TensorFlow backend (imported on first use: ~5 s)."""
  os.environ.setdefault('KERAS_BACKEND', 'tensorflow')
  import keras  # pylint: disable=g-import-not-at-top
  if keras.backend.backend() != 'tensorflow':
    raise ConfigError(f'Keras runs on the {keras.backend.backend()!r} backend',
                      fix='set KERAS_BACKEND=tensorflow before starting')
  return keras


def _current_keras_path() -> str:
  from keras.src.backend.common.name_scope import current_path  # pylint: disable=g-import-not-at-top
  return current_path()


@dataclasses.dataclass
class KerasBuild:
  """A built Keras model with its DVariables and their layout records."""
  model: Any
  variables: dict[str, Any]        # Keras path -> DVariable, creation order
  records: list[LayoutRecord]
  checkpoint_root: Any             # tf.Module holding the weights by path


def _fresh_keras(seed: int):
  keras = import_keras()
  keras.backend.clear_session()  # auto layer names (dense, dense_1) restart
  keras.utils.set_random_seed(seed)
  return keras


def build(model: KerasModel, *, mesh, rules: LayoutRules | None, seed: int,
          example_inputs: Sequence[Any] = ()) -> KerasBuild:
  """Calls `model.build_fn()` with every weight born as a DVariable laid out
  by `rules`; a model that creates weights on first call is called once on
  `example_inputs` (DTensors on `mesh`) inside the scope."""
  rules = rules if rules is not None else LayoutRules()
  mesh_axes = mesh_lib.mesh_axes(mesh)
  rules.check_mesh(mesh_axes)
  variables: dict[str, Any] = {}
  records: list[LayoutRecord] = []

  def creator(next_creator, **kwargs):
    del next_creator
    name = (kwargs.get('name') or 'variable').split(':')[0]
    parent = _current_keras_path()
    path = f'{parent}/{name}' if parent else name
    if path in variables:
      raise ConfigError(f"two Keras weights share the path '{path}'",
                        fix='give the layers (and weights) distinct names')
    value = creator_initial_value(kwargs)
    trainable = kwargs.get('trainable', True) is not False
    spec = VariableSpec(path=path, shape=tuple(value.shape.as_list()),
                        dtype=value.dtype.name, trainable=trainable)
    [record] = plan_layouts([spec], rules, mesh_axes)
    layout = dtensor.Layout(list(record.spec), mesh)
    variable = dtensor.DVariable(mesh_lib.pack_global_array(value.numpy(), layout),
                                 trainable=trainable, name=name)
    variables[path] = variable
    records.append(record)
    return variable

  keras = _fresh_keras(seed)
  with tf.variable_creator_scope(creator):
    built = model.build_fn()
    if not isinstance(built, keras.layers.Layer):
      raise ConfigError(f'{model.describe()} returned a {type(built).__name__}',
                        where='keras_model.build_fn', fix='return a keras.Model')
    if not built.built:
      with dtensor.default_mesh(mesh):
        inputs = list(example_inputs)
        built(inputs[0] if len(inputs) == 1 else inputs, training=False)
  _check_paths(built, variables)
  root = tf.Module(name=model.name)
  root.by_path = dict(variables)
  return KerasBuild(model=built, variables=variables, records=records, checkpoint_root=root)


def _check_paths(built, variables: Mapping[str, Any]) -> None:
  """Every Keras weight must be one the creator made, under the same path."""
  for weight in built.variables:
    mine = variables.get(weight.path)
    if mine is None or getattr(weight, 'value', None) is not mine:
      raise ConfigError(
          f"Keras weight '{weight.path}' was not created through meshgin's layout "
          'scope (created before build_fn ran, or assigned from elsewhere)',
          fix='create every weight inside build_fn (add_weight in build())')


def plan(model: KerasModel, *, rules: LayoutRules, mesh_axes: Mapping[str, int],
         input_specs: Sequence[tuple[tuple[int, ...], str]], seed: int = 0
         ) -> list[LayoutRecord]:
  """The layout records of `model`'s weights, without allocating them: the
  model is built in Keras' stateless scope (initialisers deferred), and a
  model that builds on first call is traced symbolically on `input_specs`."""
  keras = _fresh_keras(seed)
  with keras.StatelessScope():
    built = model.build_fn()
    if not built.built:
      symbolic = [keras.KerasTensor(shape, dtype=dtype) for shape, dtype in input_specs]
      built(symbolic[0] if len(symbolic) == 1 else symbolic)
  specs = [VariableSpec(path=w.path, shape=tuple(w.shape), dtype=str(w.dtype),
                        trainable=w.trainable) for w in built.variables]
  return plan_layouts(specs, rules, mesh_axes)
