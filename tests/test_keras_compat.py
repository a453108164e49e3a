"""LayoutMap: the Keras seed's documented examples, on plain tf.Module models."""

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.experimental import dtensor

from layout_core.compat.layout_map import LayoutMap
from layout_core.layout.variables import to_numpy
from tests.numerics import assert_close


class Dense(tf.Module):
  def __init__(self, units, name=None):
    super().__init__(name=name)
    self.units = units
    self.kernel = None

  def __call__(self, x):
    if self.kernel is None:
      self.kernel = tf.Variable(tf.random.stateless_normal([x.shape[-1], self.units], [1, 2]))
      self.bias = tf.Variable(tf.zeros([self.units]))
    return tf.matmul(x, self.kernel) + self.bias


class SubclassModel(tf.Module):
  def __init__(self):
    super().__init__()
    self.d1 = Dense(16)
    self.d2 = Dense(8)

  def __call__(self, x):
    return self.d2(self.d1(x))


def layouts(mesh):
  return (dtensor.Layout(['unsharded', 'model'], mesh), dtensor.Layout(['model'], mesh),
          dtensor.Layout(['model', 'unsharded'], mesh), dtensor.Layout.replicated(mesh, 1))


def test_lookup_exact_then_regex_in_insertion_order(mesh_2x4):
  layout_2d, layout_1d, *_ = layouts(mesh_2x4)
  layout_map = LayoutMap(mesh=mesh_2x4)
  layout_map['.*dense.*kernel'] = layout_2d
  layout_map['.*dense.*bias'] = layout_1d
  layout_map['dense_1.kernel'] = layout_1d
  assert layout_map['dense_1.kernel'] is layout_1d      # exact key first
  assert layout_map['dense_2.kernel'] is layout_2d      # then regex
  assert layout_map['my_model/dense_7/bias'] is layout_1d
  assert layout_map['conv.kernel'] is None
  assert len(layout_map) == 3 and list(layout_map)[0] == '.*dense.*kernel'
  del layout_map['dense_1.kernel']
  assert layout_map['dense_1.kernel'] is layout_2d
  assert layout_map.get_default_mesh() is mesh_2x4


def test_duplicate_key_and_non_layout_value_raise(mesh_2x4):
  layout_map = LayoutMap(mesh=mesh_2x4)
  layout_map['a'] = layouts(mesh_2x4)[0]
  with pytest.raises(ValueError, match='already'):
    layout_map['a'] = layouts(mesh_2x4)[1]
  with pytest.raises(ValueError, match='dtensor.Layout'):
    layout_map['b'] = 'not a layout'


def test_scope_maps_subclassed_model_attribute_paths(mesh_2x4):
  layout_1, layout_2, layout_3, layout_4 = layouts(mesh_2x4)
  layout_map = LayoutMap(mesh=mesh_2x4)
  layout_map['d1.kernel'] = layout_1
  layout_map['d1.bias'] = layout_2
  layout_map['d2.kernel'] = layout_3
  with layout_map.scope() as scope:
    model = scope.track(SubclassModel())
    inputs = tf.zeros((10, 10))
    reference = model(inputs)  # weights are created (replicated) on first call
  assert model.d1.kernel.layout == layout_1
  assert model.d1.bias.layout == layout_2
  assert model.d2.kernel.layout == layout_3
  assert model.d2.bias.layout == layout_4              # no key: replicated
  x = dtensor.copy_to_mesh(tf.ones((10, 10)), dtensor.Layout.replicated(mesh_2x4, 2))
  expected = np.ones((10, 10)) @ to_numpy(model.d1.kernel) + to_numpy(model.d1.bias)
  expected = expected @ to_numpy(model.d2.kernel) + to_numpy(model.d2.bias)
  # measured: - / 9e-08 / 9e-08 (default / no oneDNN / 1 thread)
  assert_close(to_numpy(model(x)), expected, rel=1e-06, what='outputs')
  assert to_numpy(reference).shape == (10, 8)


def test_lazy_build_after_the_scope_gets_layouts_and_matches_unsharded(mesh_2x4):
  layout_1, layout_2, layout_3, layout_4 = layouts(mesh_2x4)
  layout_map = LayoutMap(mesh=mesh_2x4)
  layout_map['d1.kernel'] = layout_1
  layout_map['d1.bias'] = layout_2
  layout_map['d2.kernel'] = layout_3
  with layout_map.scope() as scope:
    model = scope.track(SubclassModel())   # no weights yet
  assert model.d1.kernel is None and isinstance(model, SubclassModel)
  inputs = np.random.default_rng(0).normal(size=(10, 10)).astype(np.float32)
  x = dtensor.copy_to_mesh(tf.constant(inputs), dtensor.Layout.replicated(mesh_2x4, 2))
  first = model(x)                         # weights created here, outside the scope
  assert model.d1.kernel.layout == layout_1 and model.d1.bias.layout == layout_2
  assert model.d2.kernel.layout == layout_3 and model.d2.bias.layout == layout_4
  second = model(x)                        # now on the sharded weights
  reference = SubclassModel()(tf.constant(inputs))   # plain TF, no DTensor
  # measured: - / 0 / 0 (default / no oneDNN / 1 thread)
  assert_close(to_numpy(first), reference.numpy(), rel=1e-05, what='first call')
  # measured: - / 8e-08 / 8e-08 (default / no oneDNN / 1 thread)
  assert_close(to_numpy(second), reference.numpy(), rel=1e-06, what='second call')
  assert len(model.variables) == 4


def test_untracked_module_is_reported_not_guessed(mesh_2x4, caplog):
  layout_map = LayoutMap(mesh=mesh_2x4)
  layout_map['d1.kernel'] = layouts(mesh_2x4)[0]
  with layout_map.scope():
    model = SubclassModel()
    model(tf.zeros((2, 10)))
  assert not hasattr(model.d1.kernel, 'layout')
  assert 'belong to no tracked module' in caplog.text
