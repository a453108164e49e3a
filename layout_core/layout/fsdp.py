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

Where the batch is split over the FSDP axis (the step context's
`batch_split`, which a layer's `Weights` carry) and the math runs narrower
than the weights (bfloat16), a layer's matrices take another way, through
its `Weights.dense` / `Weights.project`: one copy per replica of the batch
(`per_replica`, an all-to-all), used with each replica's rows of the input
(`replica_einsum`), so the weight's gradient is each replica's own and comes
back to the slices with the inverse all-to-all and a float32 sum on the
slice. DTensor's all-gather and reduce-scatter move float32 rings of the
whole weight on every device on CPU: the all-to-alls leave 0.56x the bytes
at one weight's peak (`bench/fsdp_collectives.py`), and `bench/memory.py`'s
bf16 + remat + FSDP model grew from width 1664 to 1920. The gradients are
the same bit for bit.

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


def gather_at_use(variables: Sequence, dtypes: Sequence) -> list:
  """`[at_use(v, d) for v, d in zip(variables, dtypes)]` for split variables,
  gathered together: on a one-axis mesh one collective per bucket of up to
  32 MiB (`layout_core.layout.gather.gather_together`), not one per weight."""
  return gather_all(list(variables), to=[use_layout(v) for v in variables],
                    stored=[v.layout for v in variables], dtypes=dtypes)


def gather(value, *, to, stored, dtype=None):
  """`value` (laid out as `stored`) relaid to `to` (`gather_all` of one)."""
  return gather_all([value], to=[to], stored=[stored], dtypes=[dtype])[0]


def gather_all(values: Sequence, *, to: Sequence, stored: Sequence,
               dtypes: Sequence | None = None) -> list:
  """Each value (laid out as `stored[i]`) relaid to `to[i]`, several at once
  with `gather_together`, then cast to `dtypes[i]` (None: as it is; a
  narrow value is gathered as float32, `_gathered_dtype`). Each
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
    wide = [_cast(x, _gathered_dtype(x.dtype)) for x in xs]
    gathered = ([dtensor.relayout(wide[0], to[0])] if len(xs) == 1
                else gather_together(wide, stored, to))
    return [_cast(g, d or x.dtype) for g, d, x in zip(gathered, dtypes, xs)], gradient
  return list(relaid(*values))


def _gathered_dtype(dtype):
  """float32 for a narrow stored value (a frozen base in bfloat16 or int8,
  `train.frozen_dtype`): it is widened on each device's slice and gathered
  as float32, then cast as asked. TF lowers only 32- and 64-bit (and
  float16) gathers to CollectiveGatherV2; a bfloat16 or int8 one stays a
  zero-padded all-reduce, int8's in 64-bit integers: for one weight over
  data=8 that held 1.8x (bfloat16) and 3.5x (int8) the bytes of a float32
  gather, and widened first about as many as float32; under the all-reduce
  lowering widening never held more, and the values are the same
  (bench/limits/narrow_gather_limit.py). None (as it is) for any other dtype."""
  return tf.float32 if dtype in (tf.bfloat16, tf.int8) else None


# -- per-replica weights: gathered and summed with all-to-alls ------------------------
def replica_axis(variable, dtype=None, batch_split: str | None = None) -> str | None:
  """The axis `variable`, used in `dtype` in a step whose batch is split
  over `batch_split` (the step context's), is used per replica over
  (`per_replica`): the axis FSDP splits it over when that is the batch's,
  it is a matrix (vectors are gathered whole, `gather_at_use`) and `dtype`
  is narrower than the variable's; else None.

  Only narrower: DTensor's CPU collectives move float32 whatever the
  compute dtype, so in bfloat16 the all-to-alls move half the bytes and hold
  about half the memory (`bench/fsdp_collectives.py`; `bench/memory.py`'s
  bf16 + remat + FSDP model grew from width 1664 to 1920). In float32 they
  bought no larger model (width 1472 either way) and measured 0.93x
  lm_small's steps/s (`bench/step.py --groups fsdp`), so float32 weights
  keep DTensor's collectives."""
  use, axis = use_layout(variable), batch_split
  if use is None or axis is None or len(use.sharding_specs) < 2:
    return None
  if dtype is None or tf.as_dtype(dtype).size >= variable.dtype.size:
    return None
  return axis if axis in variable.layout.sharding_specs and axis not in use.sharding_specs \
      else None


def per_replica(variable, dtype=None, *, axis: str):
  """`variable` as `n` copies, one per replica of the batch axis (`axis`, of
  size n): [n, *shape], laid out as its use layout with `axis` in front, so
  each device holds the whole weight once, cast to `dtype`. For a
  contraction over the batch (`replica_einsum`), whose gradient then is
  every replica's own partial sum, with no collective.

  Both directions are one all-to-all of the compute dtype: the stored slice,
  cast, is broadcast to n rows ([n, *shape] with the stored split, local)
  and the all-to-all moves row r's slices to replica r; the gradient comes
  back by the inverse all-to-all (each device gets its slice of every
  replica's partial) and is summed there in float32, rounded to the compute
  dtype as DTensor's all-reduce does, then cast to the variable's. DTensor's
  own all-gather and reduce-scatter run on CPU as float32 rings of the whole
  weight on every device (`bench/peak_breakdown.py`); this moves the
  compute dtype and keeps one whole copy per device
  (`bench/fsdp_collectives.py`)."""
  stored, use = variable.layout, use_layout(variable)
  mesh = stored.mesh
  n = dict(zip(mesh.dim_names, mesh.shape()))[axis]
  shape = variable.shape.as_list()
  rows = dtensor.Layout([UNSHARDED, *stored.sharding_specs], mesh)
  replicas = dtensor.Layout([axis, *use.sharding_specs], mesh)

  @tf.custom_gradient
  def spread(value):
    moved = _cast(value, dtype)

    def gradient(partials):
      pieces = tf.unstack(dtensor.relayout(partials, rows), axis=0)
      total = tf.add_n([tf.cast(p, tf.float32) for p in pieces])
      return _cast(_cast(total, moved.dtype), value.dtype)
    tiled = dtensor.relayout(tf.broadcast_to(moved, [n, *shape]), rows)
    return dtensor.relayout(tiled, replicas), gradient
  return spread(variable)


def as_rows(x, n: int):
  """x [batch, ...] as [n, batch / n, ...]: each replica's rows (local)."""
  return tf.reshape(x, [n, x.shape[0] // n, *x.shape[1:]])


def lead_equation(equation: str, lead: str) -> str:
  """`equation` ('btd,dhk->bthk': x, then a weight) with the letters `lead`
  in front of each operand and the result."""
  inputs, out = equation.split('->')
  x_in, w_in = inputs.split(',')
  return f'{lead}{x_in},{lead}{w_in}->{lead}{out}'


def replica_einsum(equation: str, rows, variable, replicas, *, axis: str):
  """`tf.einsum(equation, x, w)` for x [batch, ...] split over the batch
  axis `axis`, given as `rows` = `as_rows(x, n)`, and `replicas` =
  `per_replica(variable, axis=axis)` [n, ...]: every operand gets the replica letter
  in front, so the contraction's gradient for the weights stays on each
  replica. `equation`'s x and output both start with the batch letter; the
  result is [batch, ...].

  Rows, result rows and result are pinned to the layouts DTensor gives
  `x @ w` with w gathered: split over the batch axis, each dimension w has
  as w's use layout has it, the rest whole. Each pin's gradient pins the
  backward pass's mirror of that reshape as well; unpinned, DTensor laid the
  backward's rows out whole over the replicas and all-gathered them (each
  device then computed every replica's weight gradient)."""
  inputs, out = equation.split('->')
  x_in, w_in = inputs.split(',')
  letter = next(c for c in 'rzyxwvutsqponmlkjihgfedcba' if c not in equation)
  use = use_layout(variable)

  def pin(value, subscripts, *lead):
    specs = [use.sharding_specs[w_in.index(c)] if c in w_in else UNSHARDED
             for c in subscripts]
    return dtensor.relayout(value, dtensor.Layout([*lead, *specs], use.mesh))
  rows = pin(rows, x_in[1:], axis, UNSHARDED)
  y = tf.einsum(lead_equation(equation, letter), rows, replicas)
  y = pin(y, out[1:], axis, UNSHARDED)
  return pin(tf.reshape(y, [y.shape[0] * y.shape[1], *y.shape[2:]]), out[1:], axis)


def _cast(value, dtype):
  if dtype is None or value.dtype == tf.as_dtype(dtype):
    return value
  return tf.cast(value, dtype)
