"""Replicated variables: every per-device copy stays identical through updates."""

import numpy as np
import pytest
import tensorflow as tf

from layout_core.errors import ConfigError
from layout_core.compat.replicated import ReplicatedVariable, replicated_scope


def assert_copies_equal(variable, expected):
  copies = [c.numpy() for c in variable.copies()]
  assert len(copies) == variable.num_replicas
  for copy in copies:
    np.testing.assert_array_equal(copy, expected)


def test_scope_creates_one_copy_per_device_and_updates_all(devices8):
  with replicated_scope(num_replicas=8):
    v = tf.Variable([1.0, 2.0], name='counter')
  assert isinstance(v, ReplicatedVariable) and v.num_replicas == 8
  assert v.name == 'counter' and v.shape == (2,) and v.dtype == tf.float32
  assert_copies_equal(v, [1.0, 2.0])
  v.assign([5.0, 6.0])
  assert_copies_equal(v, [5.0, 6.0])
  assert v.assign_add([1.0, 1.0]) is not None  # read_value=True by default
  assert_copies_equal(v, [6.0, 7.0])
  v.assign_sub(2.0)
  assert_copies_equal(v, [4.0, 5.0])
  assert v.assign([0.5, 0.5], read_value=True) is not None
  assert_copies_equal(v, [0.5, 0.5])


def test_usable_as_a_tensor(devices8):
  with replicated_scope(num_replicas=4):
    v = tf.Variable(3.0)
  np.testing.assert_allclose((tf.constant(1.0) + v).numpy(), 4.0)
  np.testing.assert_allclose((v * 2).numpy(), 6.0)
  np.testing.assert_allclose(tf.math.square(v).numpy(), 9.0)
  assert float(v.numpy()) == 3.0


def test_too_many_replicas_is_a_clear_error(devices8):
  with pytest.raises(ConfigError, match='num_replicas=9 but 8 CPU devices'):
    with replicated_scope(num_replicas=9):
      pass
