"""What start-up was cut to (bench/startup.py): variables made without a
function per variable, and step functions traced without AutoGraph unless
the traced code needs it; an export's signatures too (bench/export_trace.py);
TensorFlow imported with the garbage collector paused (bench/import_gc.py)."""

from __future__ import annotations

import gc
import sys

import numpy as np
import pytest

from layout_core.lazy import dtensor, import_collector_paused, tf
from layout_core.layout.scope import LayoutScope, initial_dtensor
from layout_core.layout.variables import (Constant, Normal, Ones, VariableSpec, Zeros,
                                          create_variable, path_seed, to_numpy)
from layout_core.model.built import StepFunction, traced_function


def made_under_layout(initializer, shape, layout, seed):
  """The way variables were made before: one DTensor function per tensor."""
  make = tf.function(lambda: initializer(shape, tf.float32, seed), autograph=False)
  return dtensor.call_with_layout(make, layout)


@pytest.mark.parametrize('spec', [('model', 'unsharded'), ('data', 'model'),
                                  ('model', 'data'), ('unsharded', 'unsharded')])
@pytest.mark.parametrize('shape', [(8, 12), (64, 64)])
def test_values_are_those_a_function_under_the_layout_gave(mesh_2x4, spec, shape):
  """Bit for bit, including (8, 12) on 2x4, where a shard computed on its own
  differs from the whole tensor's values in the last bit (vectorised and
  scalar log/cos: the reason the whole is computed and sliced)."""
  seed = path_seed('lm/w', 5)
  layout = dtensor.Layout(list(spec), mesh_2x4)
  for initializer in (Normal(0.02), Ones()):
    value = initial_dtensor(initializer, shape=shape, dtype='float32', layout=layout,
                            seed=seed)
    assert dtensor.fetch_layout(value) == layout
    reference = to_numpy(made_under_layout(initializer, shape, layout, seed))
    assert np.unique(reference).size > 1 or isinstance(initializer, Constant)
    assert to_numpy(value).tobytes() == reference.tobytes()


def test_each_device_holds_its_own_slice(mesh_2x4):
  """Positive control: the shards of a sharded Normal are different blocks,
  laid side by side in device order."""
  layout = dtensor.Layout(['unsharded', 'model'], mesh_2x4)
  value = initial_dtensor(Normal(1.0), shape=(4, 8), dtype='float32', layout=layout, seed=3)
  shards = [s.numpy() for s in dtensor.unpack(value)]
  assert not np.array_equal(shards[0], shards[1])
  np.testing.assert_array_equal(np.concatenate(shards[:4], axis=1), to_numpy(value))


def test_scope_traces_no_function_per_variable(mesh_2x4, monkeypatch):
  """Creating variables in the scope makes no tf.function (the old path traced
  and compiled one per variable); an integer zero works too (counters)."""
  made = []
  real_function = tf.function

  def counting(*args, **kwargs):
    made.append(args)
    return real_function(*args, **kwargs)
  monkeypatch.setattr(tf, 'function', counting)
  made_under_layout(Normal(1.0), (2,), dtensor.Layout.replicated(mesh_2x4, rank=1),
                    seed=0)  # positive control: the spy sees a function made
  assert len(made) == 1
  with LayoutScope(mesh=mesh_2x4) as scope:
    create_variable(VariableSpec(path='a/w', shape=(8, 4), initializer=Normal(0.1)))
    create_variable(VariableSpec(path='a/b', shape=(4,), initializer=Zeros()))
  counter = initial_dtensor(Zeros(), shape=(), dtype=tf.int64, seed=0,
                            layout=dtensor.Layout.replicated(mesh_2x4, rank=0))
  assert len(made) == 1
  assert len(scope.variables) == 2 and int(to_numpy(counter)) == 0


def test_step_function_skips_autograph_where_not_needed():
  step = StepFunction(lambda x: x * 2.0 + 1.0)
  assert float(step(tf.constant(3.0))) == 7.0
  assert step.autograph is False


def test_step_function_falls_back_to_autograph():
  """Positive control: Python control flow on a tensor fails without
  AutoGraph, so the function is traced again with it, with its semantics
  (a branch per call, not one fixed at trace time)."""
  def relu_like(x):
    if tf.reduce_sum(x) > 0:
      return x
    return -x
  step = StepFunction(relu_like)
  assert float(step(tf.constant(2.0))) == 2.0
  assert step.autograph is True
  assert float(step(tf.constant(-2.0))) == 2.0


def test_an_export_signature_is_traced_without_autograph_where_not_needed():
  """The traced code runs as written, not as AutoGraph's rewrite of it (which
  runs from a generated file). Positive control: `tf.function`'s default."""
  ran_from = []
  def double(x):
    ran_from.append(sys._getframe().f_code.co_filename)  # pylint: disable=protected-access
    return x * 2.0
  spec = [tf.TensorSpec([2], tf.float32)]
  _, concrete = traced_function(double, input_signature=spec)
  assert ran_from == [__file__]
  np.testing.assert_array_equal(concrete(tf.constant([1.0, 2.0])).numpy(), [2.0, 4.0])
  tf.function(double, input_signature=spec).get_concrete_function()
  assert ran_from[-1] != __file__ and 'autograph' in ran_from[-1]


def test_an_export_signature_falls_back_to_autograph():
  """Python control flow on a tensor (a user's model) is traced with
  AutoGraph: both branches are in the signature's graph."""
  def relu_like(x):
    if tf.reduce_sum(x) > 0:
      return x
    return -x
  function, concrete = traced_function(relu_like, input_signature=[tf.TensorSpec([], tf.float32)])
  assert float(concrete(tf.constant(2.0))) == 2.0 and float(concrete(tf.constant(-2.0))) == 2.0
  assert float(function(tf.constant(-3.0))) == 3.0


def test_an_import_runs_with_the_collector_paused_and_leaves_it_frozen(tmp_path, monkeypatch):
  """A module of 50,000 cycles, imported the way `layout_core.lazy` imports
  TensorFlow: the collector is off while it runs (the control: on for a
  plain import of its twin), on again after it, the module's own garbage is
  collected, and what it keeps is frozen."""
  code = ('import gc, weakref\n'
          'class Node:\n  pass\n'
          'def cycle():\n  node = Node()\n  node.me = node\n  return node\n'
          'kept = [cycle() for _ in range(50000)]\n'
          'garbage = cycle()\nGARBAGE = weakref.ref(garbage)\ndel garbage\n'
          'COLLECTOR_ON = gc.isenabled()\n')
  for name in ('cycles_paused', 'cycles_plain'):
    (tmp_path / f'{name}.py').write_text(code)
  monkeypatch.syspath_prepend(str(tmp_path))
  try:
    frozen_before = gc.get_freeze_count()
    paused = import_collector_paused('cycles_paused')
    assert not paused.COLLECTOR_ON and gc.isenabled()
    assert paused.GARBAGE() is None
    assert gc.get_freeze_count() >= frozen_before + 50000
    assert import_collector_paused('cycles_paused') is paused  # imported: returned as is
  finally:
    gc.unfreeze()  # the rest of this process collects as before
  plain = __import__('cycles_plain')
  assert plain.COLLECTOR_ON
