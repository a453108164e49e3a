"""Fully sharded parameters (FSDP, ZeRO-3): stored split, gathered at use.

With `train.fsdp`, every parameter is stored split over one more mesh axis
(the batch axis, or the one named) on the first dimension its layout rule
leaves unsharded, the axis divides and DTensor can run sharded (`add_axis`).
Its gradient and optimizer slots then have that layout too, so no device
keeps a whole copy of any of them. The math reads each weight gathered back
to the rule's layout, right where it is used:

    axis = fsdp_axis(True, batch_axis='data', mesh_axes={'data': 8})   # 'data'
    add_axis(['unsharded', 'model'], (512, 2048), 'data', 8)           # ['data', 'model']
    with LayoutScope(mesh=mesh, rules=rules, fsdp_axis=axis):
      model = params.Instantiate()     # variables stored split over 'data'
    w = at_use(model.ffn.w_in)         # inside a step: the rule's layout (an all-gather)

`LayoutScope` tags each split variable with the layout its math uses
(`set_use_layout`); `at_use` gathers a tagged variable and returns any other
as it is, so a run without FSDP traces exactly the ops it did before. The
gradient of the gather is DTensor's relayout back to the stored layout: each
device sums only its own slice of the batch's gradient. Under
`train.remat` a recomputed layer gathers its weights again in the backward
pass instead of keeping the gathered copies (FSDP2's reshard after forward).

Importing this module does not import TensorFlow.
"""

from __future__ import annotations

from typing import Collection, Mapping, Sequence

from absl import logging

from layout_core.errors import ConfigError
from layout_core.lazy import dtensor, tf
from layout_core.layout.gather import gather_together
from layout_core.layout.rules import UNSHARDED

_TAG = '_meshgin_use_layout'


def add_axis(spec: Sequence[str], shape: Sequence[int], axis: str | None, axis_size: int, *,
             skip: Collection[int] = ()) -> list[str]:
  """`spec` with `axis` on the first unsharded dimension of `shape` that
  `axis_size` divides and that is not in `skip`; `spec` itself when there is
  none, or when `axis` is None or already in it. Any such dimension splits
  the bytes evenly; the first makes each device's slice one contiguous
  block, which a gather lays beside the others without a transpose
  (`layout_core.layout.gather.gather_together`)."""
  spec = list(spec)
  if axis is None or axis in spec or axis_size < 2:
    return spec
  free = [i for i, (a, n) in enumerate(zip(spec, shape))
          if a == UNSHARDED and n % axis_size == 0 and i not in skip]
  if free:
    spec[free[0]] = axis
  return spec


def fsdp_axis(setting: bool | str, *, batch_axis: str, mesh_axes: Mapping[str, int],
              stage_axis: str | None = None) -> str | None:
  """The mesh axis `train.fsdp` splits parameters over, or None: False gives
  None; True the batch axis (None when the batch is not split, i.e. the
  mesh lacks the batch axis); a name that axis. A ConfigError when a named
  axis is not on the mesh, or is a pipeline's `stage_axis` (each stage
  keeps its own layers: their parameters split over the stage's own axes)."""
  if setting is False:
    return None
  axis = batch_axis if setting is True else setting
  if axis == UNSHARDED or (setting is True and axis not in mesh_axes):
    return None
  if axis not in mesh_axes:
    raise ConfigError(f"train.fsdp = '{axis}' is not a mesh axis",
                      where='train.fsdp / mesh.shape',
                      fix=f"use True (the batch axis) or one of {', '.join(map(repr, mesh_axes))}")
  if axis == stage_axis:
    others = [a for a in mesh_axes if a != stage_axis]
    raise ConfigError(f"train.fsdp = '{axis}' is the pipeline's stage axis",
                      where='train.fsdp / pipeline.stage_axis',
                      fix='split parameters over an axis inside each stage: True (the batch '
                          f"axis){' or ' + ', '.join(map(repr, others)) if others else ''}")
  return axis if mesh_axes[axis] > 1 else None


def log_split(records: Sequence, axis: str) -> None:
  """Logs how many parameters FSDP split, and names those it could not (no
  dimension their rule leaves free that `axis` divides)."""
  kept = [r.path for r in records if r.use_spec is None and axis not in r.spec]
  logging.info("train.fsdp: %d of %d variables stored split over '%s'; kept as their rule "
               'says (no free dimension the axis divides): %s', len(records) - len(kept),
               len(records), axis, ', '.join(kept) or 'none')


def set_use_layout(variable, layout) -> None:
  """Marks `variable` (stored with an FSDP split) as used in `layout`."""
  setattr(variable, _TAG, layout)


def use_layout(variable):
  """The layout `variable`'s math uses, when FSDP stores it split; else None."""
  return getattr(variable, _TAG, None)


def at_use(variable, dtype=None):
  """`variable` as the math uses it, cast to `dtype` if given and different:
  gathered to its use layout first when FSDP stores it split (`gather_all`)."""
  layout = use_layout(variable)
  if layout is None:
    return _cast(variable, dtype)
  return gather(variable, to=layout, stored=variable.layout, dtype=dtype)


def gather_at_use(variables: Sequence, dtypes: Sequence, *, after: Sequence = ()) -> list:
  """`[at_use(v, d) for v, d in zip(variables, dtypes)]` for split variables,
  gathered together: on a one-axis mesh one collective per bucket of up to
  32 MiB (`layout_core.layout.gather.gather_together`), not one per weight.
  The gather waits for the tensors `after` (the layer's inputs): a gather
  depends on nothing but variables, and the executor may run an op as soon
  as its inputs are ready (measured: a width-1792 bf16 + remat LM's gradients
  function peaked at 4.00 GiB with the wait, 4.09 without)."""
  with tf.control_dependencies([x for x in after if tf.is_tensor(x)]):
    return gather_all(list(variables), to=[use_layout(v) for v in variables],
                      stored=[v.layout for v in variables], dtypes=dtypes)


def gather(value, *, to, stored, dtype=None):
  """`value` (laid out as `stored`) relaid to `to` (`gather_all` of one)."""
  return gather_all([value], to=[to], stored=[stored], dtypes=[dtype])[0]


def gather_all(values: Sequence, *, to: Sequence, stored: Sequence,
               dtypes: Sequence | None = None) -> list:
  """Each value (laid out as `stored[i]`) relaid to `to[i]`, several at once
  with `gather_together`, then cast to `dtypes[i]` (None: as it is). Each
  gradient arrives in `to[i]` in that dtype, is relaid back to `stored[i]`
  (DTensor fuses the batch's sum and the split into one reduce-scatter) and
  only then cast back, on the slice.

  Measured on bench/memory.py's LM (width 1024, bf16, remat 'block', peak
  RSS): this, 1.96 GiB; the cast outside the gather (its gradient cast on
  the whole weight, between the sum and the split, so DTensor cannot fuse
  them), 3.34 GiB; the cast before the gather (gathered in bfloat16), 4.19
  GiB (10.5 GiB at width 1792).

  Both layouts are written out, not left to DTensor's `RelayoutLike`: on
  GPipe's sub-meshes that one failed to compile ("CopyToMeshOp must be used
  to send data across mesh", TF 2.21); and a gradient pinned to `to[i]`
  first keeps its split from flowing back into the layer's backward (which
  then failed to compile on `data=8`)."""
  dtypes = list(dtypes) if dtypes is not None else [None] * len(values)

  @tf.custom_gradient
  def relaid(*xs):
    def gradient(*grads):
      return [_cast(dtensor.relayout(dtensor.relayout(g, target), layout), x.dtype)
              for g, target, layout, x in zip(grads, to, stored, xs)]
    gathered = ([dtensor.relayout(xs[0], to[0])] if len(xs) == 1
                else gather_together(xs, stored, to))
    return [_cast(g, d) for g, d in zip(gathered, dtypes)], gradient
  return list(relaid(*values))


def _cast(value, dtype):
  if dtype is None or value.dtype == tf.as_dtype(dtype):
    return value
  return tf.cast(value, dtype)
