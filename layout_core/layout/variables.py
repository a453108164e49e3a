"""The one door every model variable comes through.

Layers never call `tf.Variable` themselves: they describe a variable with a
`VariableSpec` (path, shape, dtype, initializer) and call `create_variable`.
Whoever is listening (a `LayoutScope` that shards it over a mesh, a dry-run
recorder, or the default plain-variable creator) decides what gets built:

    spec = VariableSpec(path='lm/stack/block_000/ffn/w_in', shape=(64, 256),
                        initializer=Normal(stddev=0.02))
    with variable_creator(my_creator):       # e.g. LayoutScope
      w = create_variable(spec)

Initial values are a pure function of (seed, path, element index): a
counter-based hash rather than a stateful RNG. DTensor reseeds stateless RNG
ops per shard, so ordinary random initializers give different weights for
different layouts; these give bit-identical weights whatever the layout, and
each device still computes only its own shard.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging as logging_std
import math
import threading
import zlib
from typing import Callable, Iterator, Mapping

import numpy as np
from layout_core.lazy import tf, dtensor

_MASK32 = 0xFFFFFFFF


# -- counter-based initializers ------------------------------------------------
def mix32(h: tf.Tensor) -> tf.Tensor:
  """MurmurHash3's 32-bit finaliser on int64 lanes holding 32-bit values."""
  h = tf.bitwise.bitwise_xor(h, tf.bitwise.right_shift(h, 16))
  h = tf.bitwise.bitwise_and(h * 0x85EBCA6B, _MASK32)
  h = tf.bitwise.bitwise_xor(h, tf.bitwise.right_shift(h, 13))
  h = tf.bitwise.bitwise_and(h * 0xC2B2AE35, _MASK32)
  return tf.bitwise.bitwise_xor(h, tf.bitwise.right_shift(h, 16))


def _mix32_int(h: int) -> int:
  """`mix32` on a Python int, so seeds are plain constants inside tf.function."""
  h ^= h >> 16
  h = (h * 0x85EBCA6B) & _MASK32
  h ^= h >> 13
  h = (h * 0xC2B2AE35) & _MASK32
  return h ^ (h >> 16)


def flat_index(shape: tuple[int, ...],
               block: tuple[tuple[int, int], ...] | None = None) -> tf.Tensor:
  """Row-major element index of a tensor of `shape`, built by broadcasting one
  range per dim; with `block` ([start, stop) per dim), of that block only."""
  block = block or tuple((0, n) for n in shape)
  index = tf.zeros([1] * len(shape), tf.int64)
  stride = 1
  for dim in reversed(range(len(shape))):
    axis_range = tf.range(*block[dim], dtype=tf.int64) * stride
    index = index + tf.reshape(
        axis_range, [-1 if i == dim else 1 for i in range(len(shape))])
    stride *= shape[dim]
  return index


def _uniform_pair(index: tf.Tensor, seed: int) -> tuple[tf.Tensor, tf.Tensor]:
  key = _mix32_int(seed & _MASK32)
  h1 = mix32(tf.bitwise.bitwise_and(index * 2 + key, _MASK32))
  h2 = mix32(tf.bitwise.bitwise_and(h1 + 0x9E3779B9, _MASK32))
  u1 = (tf.cast(h1, tf.float32) + 1.0) / 4294967297.0  # in (0, 1]
  u2 = tf.cast(h2, tf.float32) / 4294967296.0            # in [0, 1)
  return u1, u2


class Initializer:
  """Maps (shape, dtype, seed) to a tensor; must be layout-independent.

  A subclass defines `at`, each element's value from its row-major position
  alone: then any block of the tensor can be made without the rest (each
  device makes its own shard, `layout_core.layout.scope.initial_dtensor`).
  One that overrides only `__call__` still works, made whole under DTensor.
  """

  def __call__(self, shape: tuple[int, ...], dtype: tf.DType, seed: int) -> tf.Tensor:
    return self.at(flat_index(tuple(shape)), dtype, seed)

  def at(self, index: tf.Tensor, dtype: tf.DType, seed: int) -> tf.Tensor:
    """The values of the elements at row-major positions `index` (int64, any shape)."""
    raise NotImplementedError

  @property
  def elementwise(self) -> bool:
    """Whether `at` is defined (blocks can be made on their own)."""
    return type(self).at is not Initializer.at

  def __repr__(self) -> str:
    fields = ', '.join(f'{k}={v!r}' for k, v in vars(self).items())
    return f'{type(self).__name__}({fields})'


class Normal(Initializer):
  """Gaussian via Box-Muller, clipped at +-3 stddev (a truncated normal)."""

  def __init__(self, stddev: float = 1.0):
    self.stddev = stddev

  def at(self, index, dtype, seed):
    if index.shape.rank == 0:  # a scalar
      return tf.zeros([], dtype)
    u1, u2 = _uniform_pair(index, seed)
    z = tf.sqrt(-2.0 * tf.math.log(u1)) * tf.cos(2.0 * math.pi * u2)
    return tf.cast(tf.clip_by_value(z, -3.0, 3.0) * self.stddev, dtype)


class Constant(Initializer):
  def __init__(self, value: float = 0.0):
    self.value = value

  def __call__(self, shape, dtype, seed):
    return tf.fill(list(shape), tf.constant(self.value, dtype))

  def at(self, index, dtype, seed):
    return self(index.shape.as_list(), dtype, seed)


def Zeros() -> Constant:  # pylint: disable=invalid-name
  return Constant(0.0)


def Ones() -> Constant:  # pylint: disable=invalid-name
  return Constant(1.0)


# -- specs and the creation hook -------------------------------------------------
@dataclasses.dataclass(frozen=True)
class VariableSpec:
  """Everything needed to create (or just account for) one variable."""
  path: str
  shape: tuple[int, ...]
  initializer: Initializer = dataclasses.field(default_factory=Zeros)
  dtype: str = 'float32'
  trainable: bool = True
  # dim -> why DTensor cannot run this variable sharded on it (and what works)
  unshardable: Mapping[int, str] = dataclasses.field(default_factory=dict)

  @property
  def num_elements(self) -> int:
    return math.prod(self.shape)

  @property
  def num_bytes(self) -> int:
    return self.num_elements * dtype_size(self.dtype)


_DTYPE_SIZES = {'float16': 2, 'bfloat16': 2, 'float32': 4, 'float64': 8, 'int8': 1,
                'uint8': 1, 'int16': 2, 'int32': 4, 'int64': 8, 'bool': 1}


def dtype_size(dtype: str) -> int:
  """Bytes per element of a dtype name, without importing TensorFlow."""
  try:
    return _DTYPE_SIZES[str(dtype)]
  except KeyError:
    raise ValueError(f'unknown dtype {dtype!r}; known: {", ".join(_DTYPE_SIZES)}') from None


def path_seed(path: str, seed: int) -> int:
  """A 32-bit per-variable seed: changes with the run seed and the path."""
  return zlib.crc32(f'{seed}:{path}'.encode())


def initial_value(spec: VariableSpec, seed: int) -> tf.Tensor:
  return spec.initializer(spec.shape, tf.as_dtype(spec.dtype),
                          path_seed(spec.path, seed))


Creator = Callable[[VariableSpec], 'tf.Variable']

_state = threading.local()


def _plain_creator(spec: VariableSpec) -> tf.Variable:
  return tf.Variable(initial_value(spec, seed=0), trainable=spec.trainable,
                     name=spec.path.replace('/', '.'))


def _creators() -> list[Creator]:
  if not hasattr(_state, 'creators'):
    _state.creators = []
  return _state.creators


@contextlib.contextmanager
def variable_creator(creator: Creator) -> Iterator[None]:
  """Routes every `create_variable` call in this thread to `creator`."""
  stack = _creators()
  stack.append(creator)
  try:
    yield
  finally:
    stack.pop()


def create_variable(spec: VariableSpec) -> tf.Variable:
  stack = _creators()
  return (stack[-1] if stack else _plain_creator)(spec)


def creator_initial_value(kwargs: dict) -> tf.Tensor:
  """The initial value a tf.variable_creator_scope creator was given, as a tensor."""
  initial = kwargs['initial_value']
  return tf.convert_to_tensor(initial() if callable(initial) else initial,
                              dtype=kwargs.get('dtype'))


# -- reading values back ------------------------------------------------------
def to_numpy(value) -> np.ndarray:
  """Global value of a tensor, variable or DTensor as a numpy array."""
  from tensorflow.experimental import dtensor  # pylint: disable=g-import-not-at-top
  tensor = tf.convert_to_tensor(value)
  try:
    layout = dtensor.fetch_layout(tensor)
  except Exception:  # pylint: disable=broad-except
    layout = None
  if layout is None:
    return tensor.numpy()
  if not layout.is_fully_replicated():
    tensor = dtensor.relayout(
        tensor, dtensor.Layout.replicated(layout.mesh, tensor.shape.rank))
  return dtensor.unpack(tensor)[0].numpy()


class _OneShotTraceFilter(logging_std.Filter):
  """Drops TF's "frequent retracing" warning for one-shot init functions.

  Each variable's initializer is its own tf.function, traced exactly once by
  design (it must run under that variable's layout); the warning is noise.
  """

  def filter(self, record: logging_std.LogRecord) -> bool:
    return 'triggered tf.function retracing' not in record.getMessage()


@contextlib.contextmanager
def quiet_one_shot_traces() -> Iterator[None]:
  """While variables are being created: TF's retracing warning is dropped
  (removed again on exit, whatever happens)."""
  trace_filter = _OneShotTraceFilter()
  tf.get_logger().addFilter(trace_filter)
  try:
    yield
  finally:
    tf.get_logger().removeFilter(trace_filter)
