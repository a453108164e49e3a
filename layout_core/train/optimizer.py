"""The optimizers (Adam, Adafactor) with global-norm clipping, a warmup +
decay learning-rate schedule, and optionally sharded state.

Slot variables are created with their parameter's layout (a sharded weight
gets sharded moments), keyed by the parameter's path so checkpoints can be
mapped by name:

    optimizer = make_optimizer(OptimizerConfig(learning_rate=3e-3), variables=trainable,
                               paths=paths, total_steps=1000, mesh_axes={'data': 8})
    lr, grad_norm = optimizer.apply(grads, step)   # inside a tf.function

With `shard_state` (ZeRO-1; 'auto', the default, picks it where it measured
faster: `state_axis`), every slot is also split over the data axis on the
first dimension its parameter leaves unsharded and the axis divides. The
gradients function cuts each gradient to its slot's layout
(`sliced_gradients`: DTensor then reduces only each device's slice), the
update runs on those slices, and the new parameters are gathered back to
their own layouts together, a bucket per collective (`gather_together`). A
parameter with no such dimension keeps its layout (`unsharded_state` lists
them). Checkpoints hold the same keys either way, so state moves between
sharded and unsharded runs and meshes.

Written here rather than taken from Keras because Keras 3 optimizers do not
build DTensor slot variables. With parameters on several meshes (pipeline
stages), call `update` once per mesh with that mesh's parameters, and the
global gradient norm and step as scalars on that mesh:

    lr = optimizer.update(stage_paths, stage_grads, step=step_on_mesh, norm=norm_on_mesh)
"""

from __future__ import annotations

import dataclasses
import math
from typing import Mapping, Sequence

from absl import logging

from layout_core.lazy import Module, tf, dtensor
from layout_core.errors import ConfigError
from layout_core.fields import at_least, check_types, in_range
from layout_core.layout.gather import gather_together
from layout_core.layout.variables import quiet_one_shot_traces
from layout_core.train.config import UNSHARDED

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
  beta1: float = 0.9
  beta2: float = 0.99
  epsilon: float = 1e-8
  weight_decay: float = 0.0         # decoupled (AdamW), on every parameter
  clip_norm: float = 1.0            # global-norm clipping; 0 disables
  # ZeRO-1: 'auto' (the batch axis on a one-axis mesh for models of at
  # least AUTO_MIN_PARAMETERS, else off: `state_axis`); False; True (the
  # batch axis); or a mesh axis name.
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


def learning_rate(config: OptimizerConfig, step, total_steps: int) -> tf.Tensor:
  """Schedule value at `step` (0-based); a float32 scalar tensor."""
  step = tf.cast(step, tf.float32)
  warmup = float(max(config.warmup_steps, 0))
  peak = config.learning_rate
  warm = peak * tf.minimum(1.0, (step + 1.0) / max(warmup, 1.0))
  span = max(total_steps - warmup, 1.0)
  progress = tf.clip_by_value((step - warmup) / span, 0.0, 1.0)
  floor = config.final_learning_rate_ratio
  if config.decay == 'cosine':
    factor = floor + (1.0 - floor) * 0.5 * (1.0 + tf.cos(math.pi * progress))
  elif config.decay == 'linear':
    factor = 1.0 - (1.0 - floor) * progress
  else:
    factor = tf.ones_like(progress)
  return tf.where(step < warmup, warm, peak * factor)


def squared_norm(grads: Sequence[tf.Tensor]) -> tf.Tensor:
  """Sum of squares over all grads (all on one mesh)."""
  return tf.add_n([tf.reduce_sum(tf.square(tf.convert_to_tensor(g))) for g in grads])


def global_norm(grads: Sequence[tf.Tensor]) -> tf.Tensor:
  return tf.sqrt(squared_norm(grads))


def state_axis(config: OptimizerConfig, *, batch_axis: str, mesh_axes: Mapping[str, int],
               num_parameters: int | None = None) -> str | None:
  """The mesh axis `shard_state` splits optimizer state over, or None.

  'auto' picks the batch axis where sharded state measured faster as well as
  smaller (`bench/step.py`, 2 cores): a one-axis mesh, where the gather back
  compiles to a real all-gather (`gather_lowering`), and a model of at least
  AUTO_MIN_PARAMETERS (`num_parameters`; None: assumed that large). On
  `data=8`, sharded vs unsharded: lm_tiny (0.11M parameters) 43 vs 30 ms a
  step, lm_small at width 128 (0.87M) 134 vs 128, at width 192 (1.9M) 206 vs
  225, lm_small (3.3M) 305 vs 364: below ~1.2M the collectives' fixed cost
  outweighs the smaller update. On 2-D meshes DTensor's padded all-reduce made
  it slower (lm_small 2x4: 401 vs 373 ms)."""
  if config.shard_state is False:
    return None
  if config.shard_state == AUTO:
    one_axis = list(mesh_axes) == [batch_axis] and mesh_axes[batch_axis] > 1
    large = num_parameters is None or num_parameters >= AUTO_MIN_PARAMETERS
    return batch_axis if one_axis and large else None
  axis = batch_axis if config.shard_state is True else config.shard_state
  if axis not in mesh_axes:
    if config.shard_state is True:
      logging.info("optimizer.shard_state: the batch axis '%s' is not a mesh axis (%s); "
                   'optimizer state is not sharded', axis, list(mesh_axes))
      return None
    raise ConfigError(f"optimizer.shard_state = '{axis}' is not a mesh axis",
                      where='optimizer.shard_state / mesh.shape',
                      fix=f"use True (the batch axis) or one of {', '.join(map(repr, mesh_axes))}")
  return axis


def add_axis(spec: Sequence[str], shape: Sequence[int], axis: str | None,
             axis_size: int) -> list[str]:
  """`spec` with `axis` on the first unsharded dimension of `shape` that
  `axis_size` divides; `spec` itself when there is none, or when `axis` is
  None or already in it. Any such dimension splits the bytes evenly; the
  first makes each device's slice one contiguous block, which the gather
  back lays beside the others without a transpose (`gather_together`)."""
  spec = list(spec)
  if axis is None or axis in spec or axis_size < 2:
    return spec
  free = [i for i, (a, n) in enumerate(zip(spec, shape)) if a == UNSHARDED and n % axis_size == 0]
  if free:
    spec[free[0]] = axis
  return spec


@dataclasses.dataclass
class _Targets:
  """A plain holder, so the parameters are not tracked (and checkpointed) twice."""
  variables: dict       # path -> parameter
  state_layouts: dict   # path -> the layout its update runs in (None: its own)


class Optimizer(Module):
  """What Adam and Adafactor share: the schedule, clipping, slots laid out
  like their parameter (plus the state axis), and the update loop. A subclass
  makes its slots in `_make_slots` (with `slot`) and gives each parameter's
  change in `_delta`."""

  def __init__(self, config: OptimizerConfig, *, variables: Sequence[tf.Variable],
               paths: Sequence[str], total_steps: int, shard_axis: str | None = None,
               lead_dims: Mapping[str, int] | None = None):
    super().__init__(name=config.name)
    # path -> leading dims that stack several layers' copies (the SPMD
    # engine's cells): per-parameter statistics are per stacked element.
    self.lead_dims = dict(lead_dims or {})
    if len(paths) != len(variables):
      raise ValueError(f'{len(paths)} paths for {len(variables)} variables')
    self.config, self.total_steps, self.shard_axis = config, total_steps, shard_axis
    self._targets = _Targets(dict(zip(paths, variables)), {})
    for path, variable in zip(paths, variables):
      layout = getattr(variable, 'layout', None)
      spec = None if layout is None else self._with_state_axis(
          layout.sharding_specs, variable.shape.as_list(), layout.mesh)
      self._targets.state_layouts[path] = (
          None if layout is None or spec == list(layout.sharding_specs)
          else dtensor.Layout(spec, layout.mesh))
    with quiet_one_shot_traces():
      self._make_slots(list(paths), list(variables))
    if shard_axis is not None:
      kept = [p for p, l in self._targets.state_layouts.items() if l is None]
      logging.info("optimizer.shard_state: %d of %d parameters' state split over '%s'; "
                   'kept with their parameter layout: %s', len(paths) - len(kept), len(paths),
                   shard_axis, ', '.join(kept) or 'none')

  @property
  def paths(self) -> list[str]:
    """The parameters' paths, in order."""
    return list(self._targets.variables)

  @property
  def unsharded_state(self) -> list[str]:
    """Paths whose state `shard_state` could not split (all, when it is off)."""
    return [p for p, l in self._targets.state_layouts.items() if l is None]

  def _with_state_axis(self, spec, shape, mesh) -> list[str]:
    axes = dict(zip(mesh.dim_names, mesh.shape()))
    return add_axis(spec, shape, self.shard_axis, axes.get(self.shard_axis, 1))

  def slot(self, variable, *, name: str, shape: Sequence[int] | None = None,
           drop_dim: int | None = None) -> tf.Variable:
    """A zero slot for `variable`: its shape (or its shape without `drop_dim`,
    a factored statistic), laid out as the parameter (without that dim) plus
    the state axis."""
    shape = list(variable.shape.as_list() if shape is None else shape)
    dtype, layout = variable.dtype, getattr(variable, 'layout', None)
    if layout is None:
      return tf.Variable(tf.zeros(shape, dtype), trainable=False, name=name)
    spec = list(layout.sharding_specs)
    if drop_dim is not None:
      del spec[drop_dim % len(spec)]
    spec = self._with_state_axis(spec, shape, layout.mesh)
    init = tf.function(lambda: tf.zeros(shape, dtype), autograph=False)
    return dtensor.DVariable(dtensor.call_with_layout(init, dtensor.Layout(spec, layout.mesh)),
                             trainable=False, name=name)

  def slots_for(self, path: str) -> list[tf.Variable]:
    """Every slot of the parameter at `path`."""
    raise NotImplementedError

  def _make_slots(self, paths, variables) -> None:
    raise NotImplementedError

  def _delta(self, path: str, grad, param, *, lr, step):
    """The parameter's change (subtracted) and [(slot, new value)] to assign."""
    raise NotImplementedError

  def apply(self, grads: Sequence[tf.Tensor], step: tf.Tensor):
    """One update of every parameter (all on one mesh) at 0-based `step`;
    returns (learning_rate, pre-clip global grad norm)."""
    grads = self._update_layouts(self.paths, grads)
    norm = global_norm(grads)
    return self.update(self.paths, grads, step=step, norm=norm), norm

  def _update_layouts(self, paths: Sequence[str], grads: Sequence[tf.Tensor], *,
                      pinned: bool = False) -> list:
    """The gradients in the layouts their updates run in: the state layout
    (sharded state: each device keeps its slice, no data moves), else the
    parameter's. The norm of the sliced gradients costs each device its
    slice's share, not the whole model's. `pinned`: relaid to the parameter's
    layout first (`sliced_gradients`)."""
    out = []
    for path, grad in zip(paths, grads):
      grad = tf.convert_to_tensor(grad)
      own = getattr(self._targets.variables[path], 'layout', None)
      state = self._targets.state_layouts[path]
      if pinned and state is not None:
        grad = dtensor.relayout(grad, own)
      layout = own if state is None else state
      out.append(grad if layout is None else dtensor.relayout(grad, layout))
    return out

  def sliced_gradients(self, grads: Sequence[tf.Tensor]) -> list:
    """For the function that makes the gradients (of every parameter, in
    order), with sharded state: each gradient in its state layout, so DTensor
    sums over the batch axis only the slice each device updates (lm_small,
    `data=8`: the gradients function 280 -> 267 ms). Each is first pinned to
    its parameter's layout: left free, DTensor's layout propagation pulled
    the slicing back into the backward pass and failed to compile (TF 2.21).
    Without sharded state, the gradients as they are."""
    if self.shard_axis is None:
      return list(grads)
    return self._update_layouts(self.paths, grads, pinned=True)

  def update(self, paths: Sequence[str], grads: Sequence[tf.Tensor], *, step: tf.Tensor,
             norm: tf.Tensor) -> tf.Tensor:
    """Updates the parameters at `paths`; `norm` is the global (all-parameter)
    gradient norm used for clipping. Returns the learning rate.

    With sharded state the new parameters' slices are gathered back
    together, a bucket per collective (`gather_together`), not one by one."""
    config = self.config
    lr = learning_rate(config, step, self.total_steps)
    scale = tf.minimum(1.0, config.clip_norm / (norm + 1e-12)) if config.clip_norm else None
    gathered, sources, targets = [], [], []
    for path, grad in zip(paths, self._update_layouts(paths, grads)):
      variable = self._targets.variables[path]
      if scale is not None:
        grad = grad * scale
      state_layout = self._targets.state_layouts[path]
      param = (variable if state_layout is None
               else dtensor.relayout(variable.read_value(), state_layout))
      delta, assigns = self._delta(path, grad, param, lr=lr, step=step)
      for slot, value in assigns:
        slot.assign(value if state_layout is None else dtensor.relayout(value, slot.layout))
      if state_layout is None:
        variable.assign_sub(delta)
      else:
        gathered.append((variable, param - delta))
        sources.append(state_layout)
        targets.append(variable.layout)
    new_values = gather_together([value for _, value in gathered], sources, targets)
    for (variable, _), value in zip(gathered, new_values):
      variable.assign(value)
    return lr


class Adam(Optimizer):
  """Adam(W): slots `m` and `v` (module docstring)."""

  def _make_slots(self, paths, variables):
    self.m = {p: self.slot(v, name=f'{p}/m') for p, v in zip(paths, variables)}
    self.v = {p: self.slot(v, name=f'{p}/v') for p, v in zip(paths, variables)}

  def slots_for(self, path):
    return [self.m[path], self.v[path]]

  def _delta(self, path, grad, param, *, lr, step):
    config = self.config
    t = tf.cast(step, tf.float32) + 1.0
    correction = tf.sqrt(1.0 - config.beta2 ** t) / (1.0 - config.beta1 ** t)
    # Use the new moments as computed, not re-read from the slots: in the
    # training step's DTensor function, re-reading after the assign gave the
    # old values (TF 2.21: the first step moved no parameter; a small
    # stand-alone function did not show it). tests/test_optimizer.py.
    m = config.beta1 * self.m[path] + (1.0 - config.beta1) * grad
    v = config.beta2 * self.v[path] + (1.0 - config.beta2) * tf.square(grad)
    update = m / (tf.sqrt(v) + config.epsilon)
    if config.weight_decay:
      update += config.weight_decay * param
    return lr * correction * update, [(self.m[path], m), (self.v[path], v)]


def make_optimizer(config: OptimizerConfig, *, variables: Sequence[tf.Variable],
                   paths: Sequence[str], total_steps: int,
                   mesh_axes: Mapping[str, int] | None = None,
                   batch_axis: str = 'data',
                   lead_dims: Mapping[str, int] | None = None) -> Optimizer:
  """The optimizer `config.name` names, its state split as `shard_state` says."""
  axis = state_axis(config, batch_axis=batch_axis, mesh_axes=mesh_axes or {},
                    num_parameters=sum(v.shape.num_elements() for v in variables))
  if config.name == 'adafactor':
    from layout_core.train.adafactor import Adafactor  # pylint: disable=g-import-not-at-top
    cls = Adafactor
  else:
    cls = Adam
  return cls(config, variables=variables, paths=paths, total_steps=total_steps,
             shard_axis=axis, lead_dims=lead_dims)
