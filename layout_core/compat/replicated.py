"""Replicated variables: one logical variable, one identical copy per device.

The DTensor form of the TPU `ReplicatedVariable`: the copies are the
per-device components of a fully replicated DVariable on a 1-D mesh of
`num_replicas` devices, so an update is one SPMD op that writes every copy.

    with replicated_scope(num_replicas=8):
      counter = tf.Variable(0.0)        # a ReplicatedVariable
    counter.assign_add(2.0)
    counter.copies()                    # 8 tensors, all 2.0
    tf.constant(1.0) + counter          # usable as a tensor: 3.0

Reads return the (single, replicated) value; `assign`, `assign_add` and
`assign_sub` accept a plain tensor or number and update all copies; with
`read_value=True` they return the new value.
"""

from __future__ import annotations

import contextlib

import numpy as np
import tensorflow as tf
from tensorflow.experimental import dtensor

from layout_core.errors import ConfigError
from layout_core.layout.variables import creator_initial_value


def replica_mesh(num_replicas: int, device_type: str = 'CPU') -> dtensor.Mesh:
  available = len(tf.config.list_logical_devices(device_type))
  if not 1 <= num_replicas <= available:
    raise ConfigError(f'num_replicas={num_replicas} but {available} {device_type} '
                      'devices are visible', fix=f'use 1..{available} replicas')
  return dtensor.create_mesh(
      [('replica', num_replicas)], device_type=device_type,
      devices=[f'{device_type}:{i}' for i in range(num_replicas)])


class ReplicatedVariable(tf.Module):
  """A variable kept as identical copies on every device of a mesh."""

  def __init__(self, initial_value, *, mesh: dtensor.Mesh, name: str = 'replicated',
               trainable: bool = True, dtype=None):
    super().__init__(name=None)
    value = tf.convert_to_tensor(initial_value, dtype=dtype)
    self._layout = dtensor.Layout.replicated(mesh, rank=value.shape.rank)
    self._mesh = mesh
    self.variable = dtensor.DVariable(dtensor.copy_to_mesh(value, self._layout),
                                      trainable=trainable, name=name)
    self._name = name

  # -- properties ------------------------------------------------------------------
  @property
  def name(self) -> str:
    return self._name

  @property
  def dtype(self) -> tf.DType:
    return self.variable.dtype

  @property
  def shape(self) -> tf.TensorShape:
    return self.variable.shape

  @property
  def num_replicas(self) -> int:
    return self._mesh.size

  # -- reads -------------------------------------------------------------------------
  def read_value(self) -> tf.Tensor:
    return self.variable.read_value()

  def value(self) -> tf.Tensor:
    return self.read_value()

  def copies(self) -> list[tf.Tensor]:
    """Each device's own copy (for checking they agree)."""
    return list(dtensor.unpack(self.read_value()))

  def numpy(self) -> np.ndarray:
    return self.copies()[0].numpy()

  def __getitem__(self, index):
    return self.copies()[0][index]

  # -- writes ------------------------------------------------------------------------
  def _on_mesh(self, value) -> tf.Tensor:
    value = tf.convert_to_tensor(value, dtype=self.dtype)
    try:
      if dtensor.fetch_layout(value) is not None:
        return value
    except Exception:  # pylint: disable=broad-except  # a plain tensor
      pass
    return dtensor.copy_to_mesh(tf.broadcast_to(value, self.shape), self._layout)

  def assign(self, value, read_value: bool = False):
    self.variable.assign(self._on_mesh(value))
    return self.read_value() if read_value else None

  def assign_add(self, delta, read_value: bool = True):
    self.variable.assign_add(self._on_mesh(delta))
    return self.read_value() if read_value else None

  def assign_sub(self, delta, read_value: bool = True):
    self.variable.assign_sub(self._on_mesh(delta))
    return self.read_value() if read_value else None

  def __repr__(self) -> str:
    return (f'<ReplicatedVariable {self._name!r} shape={self.shape} '
            f'replicas={self.num_replicas} value={self.numpy()}>')


def _to_tensor(variable: ReplicatedVariable, dtype=None, name=None, as_ref=False):
  del name, as_ref
  value = variable.copies()[0]
  return value if dtype is None else tf.cast(value, dtype)


tf.register_tensor_conversion_function(ReplicatedVariable, _to_tensor)

for _operator in ('__add__', '__radd__', '__sub__', '__rsub__', '__mul__', '__rmul__',
                  '__truediv__', '__rtruediv__', '__neg__', '__pow__', '__matmul__',
                  '__lt__', '__le__', '__gt__', '__ge__'):
  def _forward(self, *args, _op=_operator):
    return getattr(_to_tensor(self), _op)(*args)
  setattr(ReplicatedVariable, _operator, _forward)


@contextlib.contextmanager
def replicated_scope(num_replicas: int, device_type: str = 'CPU'):
  """Every `tf.Variable(...)` created inside becomes a ReplicatedVariable."""
  mesh = replica_mesh(num_replicas, device_type)

  def creator(next_creator, **kwargs):
    del next_creator
    return ReplicatedVariable(creator_initial_value(kwargs), mesh=mesh,
                              name=kwargs.get('name') or 'replicated',
                              trainable=kwargs.get('trainable', True) is not False)

  with tf.variable_creator_scope(creator):
    yield mesh
