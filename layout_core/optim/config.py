"""What an optimizer is asked to do, and where its state lives (TensorFlow-free).

    config = OptimizerConfig(name='adafactor', learning_rate=1e-2)
    axis = state_axis(config, batch_axis='data', mesh_axes={'data': 8},
                      parameter_shapes=[(512, 2048), (2048,)])   # 'auto': None (small)
    add_axis(['unsharded', 'model'], (512, 2048), 'data', 8)    # ['data', 'model']

The plan (`plugins.plan`), the memory estimate (`layout_core.train.memory`)
and the optimizers themselves read these, so a config is checked, and its
state laid out, by the same rules at config time and at run time. Importing
this module does not import TensorFlow.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Iterable, Mapping, Sequence

from absl import logging

from layout_core.errors import ConfigError
from layout_core.fields import at_least, check_types, in_range
from layout_core.layout.fsdp import add_axis  # noqa: F401 (re-exported: the optimizers' rule)
from layout_core.layout.rules import UNSHARDED

DECAYS = ('cosine', 'linear', 'constant')
AUTO = 'auto'
AUTO_MIN_PARAMETERS = 1_200_000  # 'auto' shards state from this model size (`state_axis`)
NAMES = ('adam', 'adafactor')


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
  name: str = 'adam'                # 'adam' | 'adafactor'
  learning_rate: float = 3e-3       # peak, reached after warmup
  warmup_steps: int = 50            # linear warmup from 0
  decay: str = 'cosine'             # after warmup: cosine | linear | constant
  final_learning_rate_ratio: float = 0.1  # lr at the last step / peak lr
  beta1: float = 0.9                # Adam first-moment decay
  beta2: float = 0.99               # Adam second-moment decay
  epsilon: float = 1e-8             # Adam: added to sqrt(second moment)
  weight_decay: float = 0.0         # decoupled (AdamW), on every parameter
  clip_norm: float = 1.0            # global-norm clipping; 0 disables
  # ZeRO-1: 'auto' (the batch axis on a one-axis mesh for models of at
  # least AUTO_MIN_PARAMETERS parameters, else off: `state_axis`); False;
  # True (the batch axis); or a mesh axis name.
  shard_state: bool | str = 'auto'
  # Adafactor (Shazeer & Stern 2018), with T5X's defaults.
  adafactor_decay_rate: float = 0.8           # second-moment decay 1 - t^-rate
  adafactor_beta1: float = 0.0                # first moment; 0: none (T5X: None)
  adafactor_clipping_threshold: float = 1.0   # update RMS clipping; 0: off
  adafactor_epsilon1: float = 1e-30           # added to squared gradients
  adafactor_epsilon2: float = 1e-3            # floor of the parameter scale
  adafactor_min_dim_to_factor: int = 128      # factor when both last dims >= this
  adafactor_multiply_by_parameter_scale: bool = True  # step x max(eps2, RMS(param))

  def __post_init__(self):
    check_types(self, name='optimizer')
    if self.name not in NAMES:
      raise ConfigError(f'optimizer.name is {self.name!r}', where='optimizer.name',
                        fix=f"use one of {', '.join(map(repr, NAMES))}")
    if self.shard_state == '':
      raise ConfigError("optimizer.shard_state is ''", where='optimizer.shard_state',
                        fix="use 'auto', False, True (the batch axis) or a mesh axis name")
    in_range(self.adafactor_decay_rate, parameter='optimizer.adafactor_decay_rate', low=0,
             high=1, low_open=True)
    in_range(self.adafactor_beta1, parameter='optimizer.adafactor_beta1', low=0, high=1,
             high_open=True)
    for field in ('adafactor_epsilon1', 'adafactor_epsilon2'):
      in_range(getattr(self, field), parameter=f'optimizer.{field}', low=0, high=1,
               low_open=True)
    at_least(self, 'optimizer', adafactor_clipping_threshold=0, adafactor_min_dim_to_factor=1)
    if self.decay not in DECAYS:
      raise ConfigError(f'optimizer.decay is {self.decay!r}', where='optimizer.decay',
                        fix=f"use one of {', '.join(map(repr, DECAYS))}")
    if not self.learning_rate > 0:
      raise ConfigError(f'optimizer.learning_rate is {self.learning_rate}',
                        where='optimizer.learning_rate', fix='use a positive learning rate')
    at_least(self, 'optimizer', warmup_steps=0, weight_decay=0, clip_norm=0)
    in_range(self.final_learning_rate_ratio, parameter='optimizer.final_learning_rate_ratio',
             low=0, high=1)
    for beta in ('beta1', 'beta2'):
      in_range(getattr(self, beta), parameter=f'optimizer.{beta}', low=0, high=1,
               high_open=True)
    in_range(self.epsilon, parameter='optimizer.epsilon', low=0, high=1, low_open=True)


@dataclasses.dataclass(frozen=True)
class SlotSpec:
  """One optimizer slot of one parameter, before it exists: `name` (the
  optimizer's attribute holding it, so its checkpoint key), `shape`, and the
  parameter dimension it leaves out (a factored statistic), if any. Each
  optimizer class says its slots with `slot_specs`; the optimizer creates
  them from it and the memory estimate counts them from it."""
  name: str
  shape: tuple[int, ...]
  dropped_dim: int | None = None

  def layout_spec(self, parameter_spec: Sequence[str], *, axis: str | None,
                  axis_size: int) -> list[str]:
    """The slot's sharding: the parameter's, less the dropped dimension, plus
    the state axis (`add_axis`)."""
    spec = list(parameter_spec)
    if self.dropped_dim is not None:
      del spec[self.dropped_dim % len(spec)]
    return add_axis(spec, self.shape, axis, axis_size)


def count_parameters(shapes: Iterable[Sequence[int]]) -> int:
  """Parameter elements in variables of these shapes: the model size 'auto' compares."""
  return sum(math.prod(shape) for shape in shapes)


def check_shard_state(config: OptimizerConfig, *, batch_axis: str,
                      mesh_axes: Mapping[str, int]) -> None:
  """A ConfigError when `shard_state` names an axis the mesh lacks (config
  time: before any parameter shape is known)."""
  if config.shard_state is not False and config.shard_state != AUTO:
    _named_axis(config, batch_axis=batch_axis, mesh_axes=mesh_axes)


def state_axis(config: OptimizerConfig, *, batch_axis: str, mesh_axes: Mapping[str, int],
               parameter_shapes: Iterable[Sequence[int]],
               fsdp_axis: str | None = None) -> str | None:
  """The mesh axis `shard_state` splits optimizer state over, or None. None
  too when that axis is `fsdp_axis` (`train.fsdp`): the parameters, and so
  their slots, are split over it already; 'auto' then picks nothing.

  'auto' picks the batch axis where sharded state measured faster as well as
  smaller (`bench/step.py`, 2 cores): a one-axis mesh, where the gather back
  compiles to a real all-gather (`tf_internals.lower_gathers_once`, decided
  by a process's first mesh), and a model of at least
  AUTO_MIN_PARAMETERS (`count_parameters` of `parameter_shapes`, the trained
  parameters). On `data=8`, sharded vs unsharded: lm_tiny (0.11M parameters)
  43 vs 30 ms a step, lm_small at width 128 (0.87M) 134 vs 128, at width 192
  (1.9M) 206 vs 225, lm_small (3.3M) 305 vs 364: below ~1.2M the
  collectives' fixed cost outweighs the smaller update. On 2-D meshes
  DTensor's padded all-reduce made it slower (lm_small 2x4: 401 vs 373 ms)."""
  if config.shard_state is False:
    return None
  if config.shard_state == AUTO:
    one_axis = list(mesh_axes) == [batch_axis] and mesh_axes[batch_axis] > 1
    large = count_parameters(parameter_shapes) >= AUTO_MIN_PARAMETERS
    axis = batch_axis if one_axis and large and fsdp_axis is None else None
  else:
    axis = _named_axis(config, batch_axis=batch_axis, mesh_axes=mesh_axes)
  return None if axis == fsdp_axis else axis


def _named_axis(config: OptimizerConfig, *, batch_axis: str,
                mesh_axes: Mapping[str, int]) -> str | None:
  """The axis True (the batch axis) or a name asks for; None (logged) when
  the batch axis is not on the mesh, a ConfigError when a named one is not."""
  axis = batch_axis if config.shard_state is True else config.shard_state
  if axis in mesh_axes:
    return axis
  if config.shard_state is True:
    logging.info("optimizer.shard_state: the batch axis '%s' is not a mesh axis (%s); "
                 'optimizer state is not sharded', axis, list(mesh_axes))
    return None
  raise ConfigError(f"optimizer.shard_state = '{axis}' is not a mesh axis",
                    where='optimizer.shard_state / mesh.shape',
                    fix=f"use True (the batch axis) or one of {', '.join(map(repr, mesh_axes))}")
