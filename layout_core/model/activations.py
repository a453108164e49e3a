"""Where a transformer's residual stream lives on a mesh of several axes.

DTensor gives every activation a layout by propagating the weights' layouts
through the graph; for the residual stream between Megatron-sharded blocks
(layer norms, residual adds, dropout) what it picked measured slower than
Megatron's own choice, which this module makes explicit: the stream split
over the batch axis only, whole on every model shard, a block's row-parallel
output summed into it once. (Split over the model axis on the time axis,
sequence-parallel style, measured slower again.) Inside

    with residual_context(mesh=mesh, batch_axis='data'):
      outputs = model.call(inputs, training)

`residual(x)` relays `x` ([batch, ...]) to that layout; outside one, and on
a mesh whose only axis is the batch axis, it returns `x` as it is. The
one-program engine and the SPMD pipeline's stage slots run their blocks in a
context; the sub-mesh pipeline's stages do not: there the relayout inside a
stage broke the backward pass's crossing between meshes ("CopyToMeshOp must
be used to send data across mesh", TF 2.21; `bench/submesh_residual_limit.py`).
Measured on lm_small, `data=2 x model=4` with `configs/layouts/megatron.gin`,
2 cores: 2.38 -> 2.68 steps/s (`bench/step.py`, in turns); the losses are the
same (tests/test_speed_paths.py).
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Sequence

from layout_core.lazy import dtensor
from layout_core.layout.rules import UNSHARDED
from layout_core.scoped import Scoped

_state = Scoped()  # (mesh, split) inside a residual_context


@contextlib.contextmanager
def residual_context(*, mesh, batch_axis: str, lead_axes: Sequence[str] = ()) -> Iterator[None]:
  """`lead_axes`: the axes of leading dims before the batch dim (the SPMD
  pipeline's stage slots: `('stage',)`)."""
  axes = dict(zip(mesh.dim_names, mesh.shape()))
  others = [n for n, size in axes.items() if size > 1 and n != batch_axis and n not in lead_axes]
  batch = batch_axis if batch_axis in axes else UNSHARDED
  with _state.set((mesh, [*lead_axes, batch]) if others else None):
    yield


def residual(x):
  """`x` ([*lead, batch, ...]) split over the batch axis (and the lead
  axes), whole elsewhere."""
  context = _state.get()
  if context is None:
    return x
  mesh, split = context
  if x.shape.rank <= len(split):
    return x
  return dtensor.relayout(
      x, dtensor.Layout(split + [UNSHARDED] * (x.shape.rank - len(split)), mesh))
