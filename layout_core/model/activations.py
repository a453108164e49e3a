"""Where a transformer's residual stream lives on a mesh of several axes.

DTensor gives every activation a layout by propagating the weights' layouts
through the graph; for the residual stream between Megatron-sharded blocks
(layer norms, residual adds, dropout) what it picked measured slower than
Megatron's own choice, which this module makes explicit: the stream split
over the batch axis only, whole on every model shard, a block's row-parallel
output summed into it once. (Split over the model axis on the time axis,
sequence-parallel style, measured slower again.) The pin is the step
context's `residual` (`layout_core.step_context`), which a block receives
with its weights:

    pin = residual_pin(mesh=mesh, batch_axis='data')   # None on a data-only mesh
    residual(x, pin)                                    # in a block: x relaid to it

`residual(x, pin)` relays `x` ([batch, ...]) to that layout; without a pin
(and a mesh whose only axis is the batch axis has none) it returns `x` as it is. The
one-program engine and the SPMD pipeline's stage slots pin it; the sub-mesh
pipeline's stages do not: there the relayout inside a
stage broke the backward pass's crossing between meshes ("CopyToMeshOp must
be used to send data across mesh", TF 2.21; `bench/limits/submesh_residual_limit.py`).
Measured on lm_small, `data=2 x model=4` with `configs/layouts/megatron.gin`,
2 cores: 2.38 -> 2.68 steps/s (`bench/step.py`, in turns); the losses are the
same (tests/test_speed_paths.py).
"""

from __future__ import annotations

from typing import Sequence

from layout_core.lazy import dtensor
from layout_core.layout.rules import UNSHARDED
from layout_core.step_context import ResidualPin


def residual_pin(*, mesh, batch_axis: str, lead_axes: Sequence[str] = ()) -> ResidualPin | None:
  """The step context's `residual` for `mesh` (None where nothing is to pin:
  the batch axis is the only one). `lead_axes`: the axes of leading dims
  before the batch dim (the SPMD pipeline's stage slots: `('stage',)`)."""
  axes = dict(zip(mesh.dim_names, mesh.shape()))
  others = [n for n, size in axes.items() if size > 1 and n != batch_axis and n not in lead_axes]
  batch = batch_axis if batch_axis in axes else UNSHARDED
  return ResidualPin(mesh, (*lead_axes, batch)) if others else None


def residual(x, pin: ResidualPin | None):
  """`x` ([*lead, batch, ...]) split over the batch axis (and the lead
  axes), whole elsewhere, as `pin` says (None: `x` as it is)."""
  if pin is None or x.shape.rank <= len(pin.split):
    return x
  return dtensor.relayout(
      x, dtensor.Layout([*pin.split] + [UNSHARDED] * (x.shape.rank - len(pin.split)), pin.mesh))
