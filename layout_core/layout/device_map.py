"""Where every slice lives: each device of a mesh, and the index ranges of
each variable it holds.

    devices = mesh_devices(mesh, stage_axis='stage')   # [{'id': 0, 'coords': [0, 0], ...}]
    slices = variable_slices(variable, mesh=mesh)
    # [Slice(index=((0, 64), (0, 16)), devices=(0, 4)), ...]: devices 0 and 4 hold
    # rows 0..63, columns 0..15, the same copy (replicas of one slice)

Read from the variables' own DTensor layouts, so a variable on a pipeline
stage's sub-mesh is placed on the devices of that sub-mesh, named by their id
in the whole `mesh` (DTensor numbers a mesh's devices row-major over its axes;
`create_distributed_mesh` gives client k ids k*L..(k+1)*L-1 for L local
devices). A device holds, along each dimension sharded over axis `a` of size
n, block `coord[a]` of n equal blocks, and the whole dimension otherwise.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Mapping, Sequence

import numpy as np

from layout_core.layout import mesh as mesh_lib
from layout_core.layout.rules import UNSHARDED


@dataclasses.dataclass(frozen=True)
class Slice:
  index: tuple[tuple[int, int], ...]   # [start, stop) per dimension
  devices: tuple[int, ...]             # ids (in the whole mesh) holding this slice

  @property
  def num_elements(self) -> int:
    return math.prod(stop - start for start, stop in self.index)


def slice_index(shape: Sequence[int], spec: Sequence[str], *, axes: Mapping[str, int],
                coords: Mapping[str, int]) -> tuple[tuple[int, int], ...]:
  """The [start, stop) ranges per dimension that the device at `coords` holds."""
  index = []
  for size, axis in zip(shape, spec):
    if axis == UNSHARDED:
      index.append((0, size))
      continue
    block = size // axes[axis]
    index.append((block * coords[axis], block * (coords[axis] + 1)))
  return tuple(index)


def _positions(mesh) -> list[tuple[int, dict[str, int]]]:
  """(device id within `mesh`, its coordinates) for every device, row-major."""
  ids = np.asarray(mesh.global_device_ids())
  names = list(mesh.dim_names)
  return [(int(ids[position]), dict(zip(names, position)))
          for position in itertools.product(*(range(n) for n in ids.shape))]


def _to_global(mesh, whole) -> Mapping[int, int] | None:
  """Device ids of a sub-mesh (pipeline stage) -> ids in `whole`, matched by
  device name (every client's); None when `mesh` is `whole` itself."""
  if mesh.to_string() == whole.to_string():
    return None
  by_name = {name: i for i, name in mesh_lib.device_names(whole).items()}
  return {i: by_name[name] for i, name in mesh_lib.device_names(mesh).items()}


def mesh_devices(mesh, *, stage_axis: str | None = None,
                 stage_meshes: Sequence | None = None) -> list[dict]:
  """Every device of `mesh` in id order: id, coordinates (in axis order),
  client (of a multi-client mesh) and pipeline stage (None unless
  `stage_axis` is one of the mesh's axes).

  With `stage_meshes` (the sub-mesh engine's stages, cut along `stage_axis`)
  a device's stage is the sub-mesh holding it and its coordinates are its
  place there, the stage index on `stage_axis`: on several clients a stage is
  a share of every client's devices (`mesh.sub_meshes`), not the devices at
  one index of the whole mesh's stage axis."""
  names = mesh_lib.device_names(mesh)
  placed = {}
  for k, sub in enumerate(stage_meshes or ()):
    sub_names = mesh_lib.device_names(sub)
    for sub_id, coords in _positions(sub):
      placed[sub_names[sub_id]] = {**coords, stage_axis: k}
  devices = []
  for device_id, coords in sorted(_positions(mesh), key=lambda p: p[0]):
    coords = placed.get(names[device_id], coords)
    devices.append({'id': device_id, 'coords': [coords[a] for a in mesh.dim_names],
                    'name': f'{mesh.device_type()}:{device_id}',
                    'client': mesh_lib.client_of(names[device_id]),
                    'stage': coords.get(stage_axis) if stage_axis else None})
  return devices


def variable_slices(variable, *, mesh) -> list[Slice]:
  """The distinct slices of a DTensor variable (or tensor) and the devices of
  `mesh` (the whole mesh) holding each, in the order of their first device."""
  layout = variable.layout
  own_mesh = layout.mesh
  axes = dict(zip(own_mesh.dim_names, own_mesh.shape()))
  to_global = _to_global(own_mesh, mesh)
  shape = variable.shape.as_list()
  holders: dict[tuple, list[int]] = {}
  for device_id, coords in _positions(own_mesh):
    index = slice_index(shape, layout.sharding_specs, axes=axes, coords=coords)
    holders.setdefault(index, []).append(
        device_id if to_global is None else to_global[device_id])
  slices = [Slice(index=index, devices=tuple(sorted(ids))) for index, ids in holders.items()]
  return sorted(slices, key=lambda s: s.devices[0])


def bytes_by_device(slices: Sequence[Slice], *, itemsize: int) -> dict[int, int]:
  """Bytes each device holds of one variable."""
  held: dict[int, int] = {}
  for piece in slices:
    for device_id in piece.devices:
      held[device_id] = held.get(device_id, 0) + piece.num_elements * itemsize
  return held
