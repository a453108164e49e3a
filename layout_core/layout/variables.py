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
different layouts; these give bit-identical weights whatever the layout
(`layout_core.layout.scope.initial_dtensor` computes each value once and
gives every device its slice).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging as logging_std
import math
import zlib
from typing import Callable, Iterator, Mapping, Sequence

import numpy as np
from layout_core.lazy import tf, dtensor
from layout_core.scoped import Scoped

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


def flat_index(shape: tuple[int, ...]) -> tf.Tensor:
  """Row-major element index of every element of a tensor of `shape` (int64):
  one range, reshaped (a handful of graph ops, against about ten per dim for
  broadcast ranges; every dropout mask draws one)."""
  return tf.reshape(tf.range(math.prod(shape), dtype=tf.int64), shape)


def _uniform_pair(shape: tuple[int, ...], seed: int) -> tuple[tf.Tensor, tf.Tensor]:
  key = _mix32_int(seed & _MASK32)
  h1 = mix32(tf.bitwise.bitwise_and(flat_index(shape) * 2 + key, _MASK32))
  h2 = mix32(tf.bitwise.bitwise_and(h1 + 0x9E3779B9, _MASK32))
  u1 = (tf.cast(h1, tf.float32) + 1.0) / 4294967297.0  # in (0, 1]
  u2 = tf.cast(h2, tf.float32) / 4294967296.0            # in [0, 1)
  return u1, u2


class Initializer:
  """Maps (shape, dtype, seed) to a tensor; must be layout-independent.

  A subclass computes the whole value as a pure function of (shape, dtype,
  seed), `seed` derived from the run's seed and the variable's path, so a
  variable starts from the same value on any layout; meshgin computes it on
  the host and gives each device its slice
  (`layout_core.layout.scope.initial_dtensor`). Use `Normal`, `Constant`,
  `Zeros()` or `Ones()`, or write one:

      class Eye(Initializer):             # an identity matrix
        def __call__(self, shape, dtype, seed):
          return tf.eye(shape[0], shape[1], dtype=dtype)
  """

  def __call__(self, shape: tuple[int, ...], dtype: tf.DType, seed: int) -> tf.Tensor:
    """The initial value of a variable of `shape` and `dtype`."""
    raise NotImplementedError

  def __repr__(self) -> str:
    fields = ', '.join(f'{k}={v!r}' for k, v in vars(self).items())
    return f'{type(self).__name__}({fields})'


class Normal(Initializer):
  """Gaussian via Box-Muller, clipped at +-3 stddev (a truncated normal)."""

  def __init__(self, stddev: float = 1.0):
    self.stddev = stddev

  def __call__(self, shape, dtype, seed):
    if not shape:
      return tf.zeros([], dtype)
    u1, u2 = _uniform_pair(tuple(shape), seed)
    z = tf.sqrt(-2.0 * tf.math.log(u1)) * tf.cos(2.0 * math.pi * u2)
    return tf.cast(tf.clip_by_value(z, -3.0, 3.0) * self.stddev, dtype)


class Constant(Initializer):
  """Every element `value` (a float, or an integer for counters)."""

  def __init__(self, value: float = 0.0):
    self.value = value

  def __call__(self, shape, dtype, seed):
    # Integers (counters) by a cast: tf.constant refuses 0.0 as an int64.
    value = tf.constant(self.value, dtype) if dtype.is_floating else tf.cast(self.value, dtype)
    return tf.fill(list(shape), value)


def Zeros() -> Constant:  # pylint: disable=invalid-name
  """`Constant(0.0)`: biases, counters."""
  return Constant(0.0)


def Ones() -> Constant:  # pylint: disable=invalid-name
  """`Constant(1.0)`: scales (a layer norm's gain)."""
  return Constant(1.0)


# -- specs and the creation hook -------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Follows:
  """A variable laid out as another where no rule names it: dimension i
  takes the split of the other's dimension `dims[i]` (None: unsplit).

      Follows('lm/stack/block/attn/wq', (64, 4, 16), dims=(None, 1, 2))
      # [r, 4, 16] split as wq's heads and head dims; r whole
  """
  path: str
  shape: tuple[int, ...]
  dims: tuple[int | None, ...]


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
  # Where no layout rule matches this variable, it takes another's layout:
  # a LoRA adapter follows its weight (`layout_core.model.lora`).
  follows: 'Follows | None' = None
  # Whose path seeds the initial value (None: its own): a stored weight's
  # quantization scale draws its weight's values (`layout_core.model.frozen`).
  seed_path: str | None = None

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
                          path_seed(spec.seed_path or spec.path, seed))


class StackedValues(Initializer):
  """The initial values of `specs` (variables alike, each drawn from its own
  path's seed), stacked and reshaped to the stacked variable's shape: the SPMD
  pipeline's stacked cells, through `initial_dtensor` like any variable."""

  def __init__(self, specs: Sequence[VariableSpec], *, seed: int):
    self.specs, self.seed = list(specs), seed

  def __call__(self, shape, dtype, seed):
    del dtype, seed  # the specs' own dtype, and each one's own path's seed
    return tf.reshape(tf.stack([initial_value(spec, self.seed) for spec in self.specs]), shape)


Creator = Callable[[VariableSpec], 'tf.Variable']

_creator = Scoped()  # the innermost variable_creator's


def _plain_creator(spec: VariableSpec) -> tf.Variable:
  return tf.Variable(initial_value(spec, seed=0), trainable=spec.trainable,
                     name=spec.path.replace('/', '.'))


@contextlib.contextmanager
def variable_creator(creator: Creator) -> Iterator[None]:
  """Routes every `create_variable` call in this thread to `creator`."""
  with _creator.set(creator):
    yield


def create_variable(spec: VariableSpec) -> tf.Variable:
  return (_creator.get() or _plain_creator)(spec)


def dvariable(value, *, path: str, trainable: bool = True):
  """A DVariable holding the DTensor `value`, for the variable at `path`.

  It is named by the path's last part ('w_in', 'm'), not the whole path:
  DTensor compiles the op that makes a variable's handle once per distinct
  name (~7.5 ms each on 8 CPU devices: bench/limits/dtensor_compile_limit.py), which
  cost the quickstart's 92 variables ~0.7 s of start-up. Nothing looks a
  variable up by its TF name: paths key the layouts, checkpoints and
  optimizer slots."""
  return dtensor.DVariable(value, trainable=trainable, name=path.rsplit('/', 1)[-1])


def creator_initial_value(kwargs: dict) -> tf.Tensor:
  """The initial value a tf.variable_creator_scope creator was given, as a tensor."""
  initial = kwargs['initial_value']
  return tf.convert_to_tensor(initial() if callable(initial) else initial,
                              dtype=kwargs.get('dtype'))


# -- reading values back ------------------------------------------------------
def to_numpy(value) -> np.ndarray:
  """Global value of a tensor, variable or DTensor as a numpy array."""
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
