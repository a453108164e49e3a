"""Frozen weights stored narrow: bfloat16, or int8 with a float scale per output channel.

A fine-tuning run never changes its frozen weights (a LoRA base, what
`train.trainable` leaves out), so they need no float32 master:
`train.frozen_dtype` stores them (and checkpoints, gathers and reads them)
as

  * 'float32': as before;
  * 'bfloat16': half the bytes; a bfloat16 checkpoint's values bit for bit;
  * 'int8': a quarter, plus a float32 scale per output channel. A matrix
    w becomes q = round(w / s) (int8, in [-127, 127]) and s = max|w| / 127
    over the dims the layer contracts with its input (`Declared.inputs`;
    the last dim of a matrix that has none, e.g. an embedding table's
    rows), kept as `<name>_scale` with those dims of size 1. Vectors (norm
    gains, biases) stay float32.

    specs = stored_specs(spec, inputs=1, frozen_dtype='int8')   # [w int8, w_scale]
    q, s = quantize(w, axes=(0,))           # w ~= q * s within s / 2 per element
    dequantized(q, s, 'float32')            # what the layer's math reads

The math reads a weight through `layout_core.model.weights.Weights`, which
multiplies in the scale (`w(name)`), and contracts with a narrow frozen
weight through `recomputed_contraction`: its backward computes the
dequantized weight again from the stored one, so no float copy of a frozen
weight is kept between the forward and the backward pass.

Weights come in quantized from a float checkpoint (`checkpoint.init_from`):
`layout_core.checkpoint.shard_io` hands an int8 variable read from a float
tensor to `assign_quantized`, which quantizes it on the mesh and sets its
scale (`scale_of`), so a run's base is quantized once, at its start.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import numpy as np

from layout_core.errors import ConfigError
from layout_core.lazy import dtensor, tf
from layout_core.layout.variables import Follows, Initializer, VariableSpec

FROZEN_DTYPES = ('float32', 'bfloat16', 'int8')
SCALE_SUFFIX = '_scale'
INT8_MAX = 127.0
_SCALE_TAG = '_meshgin_scale'


def check_frozen_dtype(value: str) -> None:
  if value not in FROZEN_DTYPES:
    raise ConfigError(f'train.frozen_dtype is {value!r}', where='train.frozen_dtype',
                      fix=f"use one of {', '.join(map(repr, FROZEN_DTYPES))}")


def quantization_axes(shape: Sequence[int], inputs: int, lead: int = 0) -> tuple[int, ...]:
  """The dims a matrix's scale is taken over: its `inputs` dims after the
  `lead` ones (those the layer contracts with its input; an expert's, per
  expert), else its last dim."""
  return tuple(range(lead, lead + inputs)) if inputs else (len(shape) - 1,)


def scale_shape(shape: Sequence[int], axes: Sequence[int]) -> tuple[int, ...]:
  return tuple(1 if i in axes else n for i, n in enumerate(shape))


def axes_of(shape: Sequence[int], scale: Sequence[int]) -> tuple[int, ...]:
  """The quantization axes of a weight of `shape` whose scale is `scale`."""
  return tuple(i for i, (n, s) in enumerate(zip(shape, scale)) if s == 1 and n != 1)


# -- the math ----------------------------------------------------------------------------
def quantize(w, axes: Sequence[int]):
  """(q int8, scale float32) with w ~= q * scale: symmetric, per channel
  (scale = max|w| / 127 over `axes`, kept as size-1 dims; 1 where a channel
  is all zeros), q rounded half to even. Works on DTensors."""
  w = tf.cast(w, tf.float32)
  largest = tf.reduce_max(tf.abs(w), axis=list(axes), keepdims=True)
  scale = tf.where(largest > 0, largest / INT8_MAX, tf.ones_like(largest))
  q = tf.clip_by_value(tf.round(w / scale), -INT8_MAX, INT8_MAX)
  return tf.cast(q, tf.int8), scale


def dequantized(q, scale, dtype) -> tf.Tensor:
  """q * scale in `dtype` (scale broadcast over its size-1 dims)."""
  return tf.cast(q, dtype) * tf.cast(scale, dtype)


def recomputed_contraction(contract: Callable, x, parts: Sequence, weight_of: Callable):
  """contract(x, weight_of(*parts)) whose backward recomputes the weight
  from `parts` (the stored tensors: a narrow weight, its scale) instead of
  keeping it: the frozen weight has no gradient, and x's gradient needs the
  weight again. Kept between the passes: x and the stored parts only."""
  @tf.custom_gradient
  def run(x, *parts):
    def gradient(dy):
      with tf.GradientTape(watch_accessed_variables=False) as tape:
        tape.watch(x)
        # Made again when the backward reaches it (not during the forward).
        weight = weight_of(tied(parts[0], dy), *parts[1:])
        y = contract(x, weight)  # only its gradient runs: no forward kept
      return (tape.gradient(y, x, output_gradients=dy),) + (None,) * len(parts)
    # Made when the forward reaches it, not as the step starts.
    return contract(x, weight_of(tied(parts[0], x), *parts[1:])), gradient
  return run(x, *parts)


def tied(stored, to):
  """`stored` plus 0 x the sum of `to` (exact for finite values): a copy
  that exists only once `to` does.

  An op whose inputs are variables alone may run as soon as the step
  starts; a frozen weight's float copy made there lives until its layer
  runs, every layer's at once (LoRA at width 1024 on data=8: evaluation
  peaked 0.3 GiB higher with a bfloat16 base than a float32 one). A control
  dependency did not hold it back under DTensor; this data dependency does."""
  zero = tf.reduce_sum(tf.cast(to, tf.float32)) * 0.0
  return stored + tf.cast(zero, stored.dtype)


# -- the variables ---------------------------------------------------------------------
class QuantizedValues(Initializer):
  """q of `initializer`'s values (`quantize` over `axes`): a frozen int8
  weight that starts from no checkpoint starts from its float start, quantized."""

  def __init__(self, initializer: Initializer, axes: tuple[int, ...]):
    self.initializer, self.axes = initializer, axes

  def __call__(self, shape, dtype, seed):
    return quantize(self.initializer(shape, tf.float32, seed), self.axes)[0]


class QuantizationScales(Initializer):
  """The scale of `QuantizedValues` of the weight of `shape` (drawn with the
  weight's seed: the scale spec's `seed_path` is the weight's)."""

  def __init__(self, initializer: Initializer, shape: tuple[int, ...], axes: tuple[int, ...]):
    self.initializer, self.shape, self.axes = initializer, shape, axes

  def __call__(self, shape, dtype, seed):
    del shape, dtype
    return quantize(self.initializer(self.shape, tf.float32, seed), self.axes)[1]


def stored_specs(spec: VariableSpec, *, inputs: int, frozen_dtype: str,
                 lead: int = 0) -> list[VariableSpec]:
  """The variables a frozen float32 `spec` is stored as under `frozen_dtype`
  (module doc): itself, itself in bfloat16, or an int8 matrix and its scale
  (a scale laid out as its weight where no rule names it, its quantization
  dims whole)."""
  if spec.trainable or spec.dtype != 'float32' or frozen_dtype == 'float32':
    return [spec]
  if frozen_dtype == 'bfloat16':
    return [dataclasses.replace(spec, dtype='bfloat16')]
  if len(spec.shape) < 2:
    return [spec]
  axes = quantization_axes(spec.shape, inputs, lead)
  return [
      dataclasses.replace(spec, dtype='int8', initializer=QuantizedValues(spec.initializer, axes)),
      VariableSpec(path=spec.path + SCALE_SUFFIX, shape=scale_shape(spec.shape, axes),
                   initializer=QuantizationScales(spec.initializer, tuple(spec.shape), axes),
                   dtype='float32', trainable=False, seed_path=spec.path,
                   follows=Follows(spec.path, tuple(spec.shape),
                                   tuple(None if i in axes else i
                                         for i in range(len(spec.shape)))))]


def is_scale(path: str) -> bool:
  return path.endswith(SCALE_SUFFIX)


def pair_scale(variable, scale) -> None:
  """Tags the int8 `variable` with its scale variable (`scale_of`)."""
  setattr(variable, _SCALE_TAG, scale)


def scale_of(variable):
  """The scale variable paired with an int8 variable (`pair_scale`), or None."""
  return getattr(variable, _SCALE_TAG, None)


def assign_quantized(variable, value) -> None:
  """Sets the int8 `variable` and its scale variable (`scale_of`) from the
  float `value`, laid out as the variable: quantized where it lies (a
  split weight's scale taken over the whole weight)."""
  scale = scale_of(variable)
  if scale is None:
    raise ValueError(f'{variable.name} is int8 without a scale; the checkpoint holds floats')
  q, s = quantize(value, axes_of(variable.shape.as_list(), scale.shape.as_list()))
  variable.assign(q)
  layout = getattr(scale, 'layout', None)
  scale.assign(s if layout is None else dtensor.relayout(s, layout))


def pair_scales(variables) -> None:
  """Pairs every `<path>_scale` in `variables` (path -> variable) with `<path>`."""
  for path, variable in variables.items():
    if is_scale(path) and path[:-len(SCALE_SUFFIX)] in variables:
      pair_scale(variables[path[:-len(SCALE_SUFFIX)]], variable)


# -- host side (exports, imports, tests' references live elsewhere) ----------------------
def dequantized_np(q: np.ndarray, scale: np.ndarray) -> np.ndarray:
  """A stored int8 weight as float32 on the host (an export)."""
  return q.astype(np.float32) * scale.astype(np.float32)
