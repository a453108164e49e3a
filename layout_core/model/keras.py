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
                  seed=0, input_specs=[((32, 16), 'float32')])
    built.variables['hidden/kernel'].layout           # sharded over 'model'

Paths: a weight's path is its Keras `variable.path` (`<layer name>/<weight
name>`, e.g. `hidden/kernel`; layers nested in a subclassed layer or model add
their names: `block/dense/kernel`). Rules match these paths, the layout table
lists them and checkpoints key the weights by them. Keras' automatic layer
names (`dense`, `dense_1`) count per session, so `build` clears Keras' session
first; name your layers to keep paths stable when the model changes.

How: `build_fn()` runs in Keras' `StatelessScope`, which gives every weight
its path, shape and initializer but defers its value (a model that creates
weights on first call is called once on symbolic inputs). Then each weight
is initialised in turn inside a variable creator that knows its path, so it
is born as a DVariable with its rule's layout. `plan` stops before the
initialisation: it lists the weights without allocating any, which is what
`launch.inspect` shows for a Keras model.

Initial values: Keras' initializers run once on the host, unsharded, seeded
with `keras.utils.set_random_seed(seed)` before the model is built (so they do
not depend on the layout, unlike stateless random ops run per shard), and each
device receives only its slice. The price: each weight exists once in full on
the host while it is created.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from typing import Any, Callable, Mapping, Sequence

from layout_core.layout import mesh as mesh_lib
from layout_core.errors import ConfigError
from layout_core.layout.scope import LayoutRecord, plan_layouts
from layout_core.lazy import dtensor, tf
from layout_core.model.built import BuiltModel
from layout_core.layout.rules import LayoutRules
from layout_core.layout.variables import VariableSpec, creator_initial_value, dvariable


@dataclasses.dataclass(frozen=True)
class KerasModel:
  """A Keras 3 model to train: `build_fn()` returns a `keras.Model` (or Layer)."""
  build_fn: Callable[[], Any] | None = None  # returns the keras.Model; gin: @my_model
  name: str = 'keras_model'                   # checkpoint/module name of the weights

  def __post_init__(self):
    if not callable(self.build_fn):
      raise ConfigError(f'keras_model.build_fn is {self.build_fn!r}',
                        where='keras_model.build_fn',
                        fix='bind a function returning a keras.Model, registered with '
                            'plugins.registry.register_keras_model, without parentheses: '
                            'keras_model.build_fn = @my_model')

  def describe(self) -> str:
    target = getattr(self.build_fn, '__wrapped__', self.build_fn)
    return (f'Keras model from {getattr(target, "__module__", "?")}.'
            f'{getattr(target, "__qualname__", repr(target))}')


def import_keras():
  """Keras 3 with the TensorFlow backend (imported on first use: ~5 s).

  A model module calls it once at the top, so Keras is set to TensorFlow
  before it loads: `keras = import_keras()`.

  Raises:
    ConfigError: Keras runs on another backend (`KERAS_BACKEND` names
      another, or Keras was loaded with one before).
  """
  os.environ.setdefault('KERAS_BACKEND', 'tensorflow')
  import keras  # pylint: disable=g-import-not-at-top
  if keras.backend.backend() != 'tensorflow':
    raise ConfigError(f'Keras runs on the {keras.backend.backend()!r} backend',
                      fix='set KERAS_BACKEND=tensorflow before starting')
  return keras


def _fresh_keras(seed: int):
  keras = import_keras()
  keras.backend.clear_session()  # auto layer names (dense, dense_1) restart
  keras.utils.set_random_seed(seed)
  return keras


def _input_mismatch(model: KerasModel, input_specs, detail: str) -> ConfigError:
  shapes = ', '.join(str(list(shape)) for shape, _ in input_specs)
  return ConfigError(f'{model.describe()} cannot take the task\'s inputs of shape {shapes}: '
                     f'{detail}', where='keras_model.build_fn / the task\'s features',
                     fix='make the model\'s input shape match the data\'s feature shape')


def _check_declared_inputs(model: KerasModel, built, input_specs) -> None:
  """A functional model's declared input shapes against the task's, by name
  of both shapes (not discovered later as an error deep inside a step)."""
  declared = getattr(built, 'inputs', None)
  if not declared or len(declared) != len(input_specs):
    return
  for tensor, (shape, _) in zip(declared, input_specs):
    want = tuple(tensor.shape)[1:]
    if len(want) != len(shape) - 1 or any(w is not None and w != g
                                          for w, g in zip(want, shape[1:])):
      raise _input_mismatch(model, input_specs, f'the model declares inputs of shape '
                            f'{[None, *want]} (batch first)')


def _stateless_build(model: KerasModel, keras, input_specs, *, compute_dtype: str = 'float32',
                     remat: str = 'none'):
  """`model.build_fn()` in Keras' stateless scope: every weight exists with its
  path, shape and initializer but no value yet. A model that creates weights
  on first call is called once on symbolic inputs of `input_specs`.

  Layers take Keras' dtype policy and remat mode when they are made: with
  `compute_dtype` 'bfloat16' the policy is 'mixed_bfloat16' (float32 weights,
  bfloat16 math), and any `remat` but 'none' recomputes every layer's
  activation function (`keras.RematScope(mode='activations')`): Keras' whole-
  layer modes fail inside tf.function on the TensorFlow backend
  (bench/limits/keras_remat_limit.py)."""
  policy = keras.config.dtype_policy()
  if compute_dtype != 'float32':
    keras.config.set_dtype_policy(f'mixed_{compute_dtype}')
  remat_scope = (keras.RematScope(mode='activations') if remat != 'none'
                 else contextlib.nullcontext())
  try:
    with keras.StatelessScope(initialize_variables=False), remat_scope:
      built = model.build_fn()
      if not isinstance(built, keras.layers.Layer):
        raise ConfigError(f'{model.describe()} returned a {type(built).__name__}',
                          where='keras_model.build_fn', fix='return a keras.Model')
      if not built.built:
        symbolic = [keras.KerasTensor(shape, dtype=dtype) for shape, dtype in input_specs]
        try:
          built(symbolic[0] if len(symbolic) == 1 else symbolic)
        except ValueError as e:
          raise _input_mismatch(model, input_specs, str(e).strip().splitlines()[0]) from None
      _check_declared_inputs(model, built, input_specs)
  except ValueError as e:
    if 'stateless scope' not in str(e):
      raise
    raise ConfigError(f'{model.describe()} creates a weight from a value, not an '
                      f'initializer: {" ".join(str(e).split())[:200]}',
                      where='keras_model.build_fn',
                      fix='create weights with add_weight(shape=..., initializer=...)') from e
  finally:
    keras.config.set_dtype_policy(policy)
  return built


def _forget_deferred_weights() -> None:
  """Keras keeps a global list of weights awaiting initialisation; ours are
  initialised (or only planned), so later Keras scopes must not touch them."""
  from keras.src.backend.common import global_state  # pylint: disable=g-import-not-at-top
  global_state.set_global_attribute('uninitialized_variables', [])


def build(model: KerasModel, *, mesh, rules: LayoutRules | None, seed: int,
          input_specs: Sequence[tuple[tuple[int, ...], str]] = (),
          compute_dtype: str = 'float32', remat: str = 'none') -> BuiltModel:
  """Builds `model` with every weight born as a DVariable laid out by `rules`.

  The model is first built statelessly (weights have paths, no values), then
  each weight is initialised in turn through a variable creator that knows
  its path: Keras' initializer runs on the host and each device receives its
  slice of the value."""
  rules = rules if rules is not None else LayoutRules()
  mesh_axes = mesh_lib.mesh_axes(mesh)
  rules.check_mesh(mesh_axes)
  keras = _fresh_keras(seed)
  built = _stateless_build(model, keras, input_specs, compute_dtype=compute_dtype, remat=remat)
  variables: dict[str, Any] = {}
  records: list[LayoutRecord] = []
  for weight in built.variables:
    if weight.path in variables:
      raise ConfigError(f"two Keras weights share the path '{weight.path}'",
                        fix='give the layers (and weights) distinct names')

    def creator(next_creator, path=weight.path, **kwargs):
      del next_creator
      value = creator_initial_value(kwargs)
      trainable = kwargs.get('trainable', True) is not False
      spec = VariableSpec(path=path, shape=tuple(value.shape.as_list()),
                          dtype=value.dtype.name, trainable=trainable)
      [record] = plan_layouts([spec], rules, mesh_axes)
      layout = dtensor.Layout(list(record.spec), mesh)
      records.append(record)
      return dvariable(mesh_lib.pack_global_array(value.numpy(), layout), path=path,
                       trainable=trainable)

    with tf.variable_creator_scope(creator):
      weight._deferred_initialize()  # pylint: disable=protected-access
    variables[weight.path] = weight.value
  _forget_deferred_weights()
  root = tf.Module(name=model.name)
  root.by_path = dict(variables)
  lines = [model.describe()] + [f'{r.path} : {list(r.shape)} {r.dtype}' for r in records]

  def call(inputs, training):
    return built(inputs[0] if len(inputs) == 1 else list(inputs), training=training)
  return BuiltModel(module=built, call=call, variables=variables, records=records,
                    checkpoint_root=root, description='\n'.join(lines) + '\n')


def plan(model: KerasModel, *, rules: LayoutRules, mesh_axes: Mapping[str, int],
         input_specs: Sequence[tuple[tuple[int, ...], str]], seed: int = 0
         ) -> list[LayoutRecord]:
  """The layout records of `model`'s weights, without allocating them (the
  stateless build of `build`, with no initialisation afterwards)."""
  keras = _fresh_keras(seed)
  built = _stateless_build(model, keras, input_specs)
  specs = [VariableSpec(path=w.path, shape=tuple(w.shape), dtype=str(w.dtype),
                        trainable=w.trainable) for w in built.variables]
  _forget_deferred_weights()
  return plan_layouts(specs, rules, mesh_axes)
