"""What every optimizer shares: clipping, the schedule, slots laid out like
their parameter (plus the state axis), and the update loop.

    class Sgd(Optimizer):
      SLOT_NAMES = ()
      @classmethod
      def slot_specs(cls, shape, config): return ()
      def _delta(self, path, grad, param, *, lr, shared): return lr * grad, []

A subclass names its slots once, in `slot_specs` (TensorFlow-free: the memory
estimate reads the same description), and gives each parameter's change in
`_delta`; what every parameter's change needs at a step (Adam's bias
correction, Adafactor's decay) it computes once per update in `_shared`,
which `_delta` receives: a step function traces and compiles those ops once,
not once per parameter. Slots are created with their parameter's layout (a
sharded weight gets sharded moments) and kept in one dict per slot name,
keyed by the parameter's path, so checkpoints are keyed `<slot name>/<path>`.

With sharded state (`shard_axis`, ZeRO-1: `layout_core.optim.config.state_axis`)
every slot is also split over that axis on the first dimension its parameter
leaves unsharded and the axis divides. The gradients function cuts each
gradient to its slot's layout (`sliced_gradients`: DTensor then reduces only
each device's slice), the update runs on those slices, and the new parameters
are gathered back to their own layouts together, a bucket per collective
(`gather_together`). A parameter with no such dimension keeps its layout
(`unsharded_state` lists them). Checkpoints hold the same keys either way, so
state moves between sharded and unsharded runs and meshes.

With parameters on several meshes (pipeline stages), call `update` once per
mesh with that mesh's parameters, and the global gradient norm and step as
scalars on that mesh:

    lr = optimizer.update(stage_paths, stage_grads, step=step_on_mesh, norm=norm_on_mesh)
"""

from __future__ import annotations

import dataclasses
from typing import Mapping, Sequence

from absl import logging

from layout_core.lazy import Module, tf, dtensor
from layout_core.layout.gather import gather_together
from layout_core.layout.scope import initial_dtensor
from layout_core.layout.variables import Zeros, dvariable, quiet_one_shot_traces
from layout_core.optim.config import OptimizerConfig, SlotSpec, add_axis
from layout_core.optim.schedule import learning_rate


def squared_norm(grads: Sequence[tf.Tensor]) -> tf.Tensor:
  """Sum of squares over all grads (all on one mesh)."""
  return tf.add_n([tf.reduce_sum(tf.square(tf.convert_to_tensor(g))) for g in grads])


def global_norm(grads: Sequence[tf.Tensor]) -> tf.Tensor:
  return tf.sqrt(squared_norm(grads))


@dataclasses.dataclass
class _ParameterRefs:
  """The parameters an optimizer updates, by path, with the layout each one's
  update runs in. A plain holder rather than tf.Module attributes, so the
  parameters are not tracked (and checkpointed) a second time."""
  variables: dict       # path -> parameter
  state_layouts: dict   # path -> the layout its update runs in (None: its own)


class Optimizer(Module):
  """The shared part of Adam and Adafactor (module docstring)."""

  # The attributes holding the slots (path -> variable), one per slot name;
  # each is a checkpoint key's first component, so these names are fixed.
  SLOT_NAMES: tuple[str, ...] = ()

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
    self._parameters = _ParameterRefs(dict(zip(paths, variables)), {})
    for path, variable in zip(paths, variables):
      layout = getattr(variable, 'layout', None)
      spec = None if layout is None else self._with_state_axis(
          layout.sharding_specs, variable.shape.as_list(), layout.mesh)
      self._parameters.state_layouts[path] = (
          None if layout is None or spec == list(layout.sharding_specs)
          else dtensor.Layout(spec, layout.mesh))
    with quiet_one_shot_traces():
      self._make_slots(list(paths), list(variables))
    if shard_axis is not None:
      kept = self.unsharded_state
      logging.info("optimizer.shard_state: %d of %d parameters' state split over '%s'; "
                   'kept with their parameter layout: %s', len(paths) - len(kept), len(paths),
                   shard_axis, ', '.join(kept) or 'none')

  @classmethod
  def slot_specs(cls, shape: Sequence[int], config: OptimizerConfig) -> tuple[SlotSpec, ...]:
    """The slots a parameter of `shape` gets (TensorFlow-free: the memory
    estimate counts them)."""
    raise NotImplementedError

  @property
  def paths(self) -> list[str]:
    """The parameters' paths, in order."""
    return list(self._parameters.variables)

  @property
  def unsharded_state(self) -> list[str]:
    """Paths whose state `shard_state` could not split (all, when it is off)."""
    return [p for p, l in self._parameters.state_layouts.items() if l is None]

  def _with_state_axis(self, spec, shape, mesh) -> list[str]:
    axes = dict(zip(mesh.dim_names, mesh.shape()))
    return add_axis(spec, shape, self.shard_axis, axes.get(self.shard_axis, 1))

  def _make_slots(self, paths: Sequence[str], variables: Sequence[tf.Variable]) -> None:
    for name in self.SLOT_NAMES:
      setattr(self, name, {})
    for path, variable in zip(paths, variables):
      for spec in self.slot_specs(variable.shape.as_list(), self.config):
        getattr(self, spec.name)[path] = self._slot_variable(variable, spec, path=path)

  def _slot_variable(self, variable, spec: SlotSpec, *, path: str) -> tf.Variable:
    """A zero slot for `variable` as `spec` describes it, laid out as the
    parameter (without the dropped dim) plus the state axis."""
    shape, dtype = list(spec.shape), variable.dtype
    layout = getattr(variable, 'layout', None)
    name = f'{path}/{spec.name}'
    if layout is None:
      return tf.Variable(tf.zeros(shape, dtype), trainable=False, name=name)
    axes = dict(zip(layout.mesh.dim_names, layout.mesh.shape()))
    sharding = spec.layout_spec(layout.sharding_specs, axis=self.shard_axis,
                                axis_size=axes.get(self.shard_axis, 1))
    zeros = initial_dtensor(Zeros(), shape=shape, dtype=dtype, seed=0,
                            layout=dtensor.Layout(sharding, layout.mesh))
    return dvariable(zeros, path=name, trainable=False)

  def slots_for(self, path: str) -> list[tf.Variable]:
    """Every slot of the parameter at `path`, in `SLOT_NAMES` order."""
    return [getattr(self, name)[path] for name in self.SLOT_NAMES
            if path in getattr(self, name)]

  def _shared(self, step: tf.Tensor, lr: tf.Tensor) -> dict:
    """What every parameter's `_delta` needs at 0-based `step` with learning
    rate `lr`, computed once per update (per mesh)."""
    return {}

  def _delta(self, path: str, grad, param, *, lr, shared: dict):
    """The parameter's change (subtracted) and [(slot, new value)] to assign."""
    raise NotImplementedError

  def apply(self, grads: Sequence[tf.Tensor], step: tf.Tensor):
    """One update of every parameter (all on one mesh) at 0-based `step`;
    returns (learning_rate, pre-clip global grad norm)."""
    grads = self._update_layouts(self.paths, grads)
    norm = global_norm(grads)
    return self._update(self.paths, grads, step=step, norm=norm), norm

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
      own = getattr(self._parameters.variables[path], 'layout', None)
      state = self._parameters.state_layouts[path]
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
    return self._update(paths, self._update_layouts(paths, grads), step=step, norm=norm)

  def _update(self, paths: Sequence[str], grads: Sequence[tf.Tensor], *, step: tf.Tensor,
              norm: tf.Tensor) -> tf.Tensor:
    """`update` of gradients already in their update layouts."""
    config = self.config
    lr = learning_rate(config, step, self.total_steps)
    shared = self._shared(step, lr)
    scale = tf.minimum(1.0, config.clip_norm / (norm + 1e-12)) if config.clip_norm else None
    gathered, sources, targets = [], [], []
    for path, grad in zip(paths, grads):
      variable = self._parameters.variables[path]
      if scale is not None:
        grad = grad * scale
      state_layout = self._parameters.state_layouts[path]
      param = (variable if state_layout is None
               else dtensor.relayout(variable.read_value(), state_layout))
      delta, assigns = self._delta(path, grad, param, lr=lr, shared=shared)
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
