"""Checkpoint tensors written and read as slices, from the devices that hold them.

A sharded variable is saved the way TF's own DTensor save does it: every
distinct shard is written once, by the device that holds it, as a *slice* of
the global tensor (`SaveV2` with a shape-and-slice spec such as
`"64 256 0,64:128,128"`), into a bundle of its own; one `MergeV2Checkpoints`
then joins those bundles into a single standard checkpoint (it only rewrites
the index and renames the data files: no tensor bytes are copied). Nothing
is ever concatenated on the host, so no process needs the whole state in
memory, and in a multi-client run each client writes only the shards its own
devices hold. Restore asks `RestoreV2` for exactly the slice each device
needs, so a checkpoint restores into any mesh shape or layout.

    entries = checkpoint_entries({'model': model, 'optimizer': adam})
    parts = write_shards(entries, directory=tmp, client_id=0,
                         object_graph=object_graph(state))   # this client's bundles
    merge_parts(find_parts(tmp), prefix=f'{tmp}/ckpt')       # client 0, after a barrier
    read_entries(f'{tmp}/ckpt', entries)                     # every client

Each entry maps one checkpoint key to one variable, or to one element of a
variable's leading dimensions (`index`): a stacked variable `[S, Q, ...]`
(the SPMD pipeline's cells, tagged with `layout_core.layout.stacked_keys`)
is stored as S*Q keys, each holding `variable[s, q]`, so its checkpoint
matches the unstacked model.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import itertools
import os
import re
import zlib
from typing import Collection, Iterable, Mapping, Sequence

import numpy as np

from layout_core.lazy import dtensor, tf
from layout_core.layout.mesh import pack_global_array
from layout_core.layout.rules import UNSHARDED
from layout_core.layout.stacked_keys import unstacked_key, unstacked_pieces
from layout_core.layout.variables import to_numpy

VALUE_SUFFIX = '/.ATTRIBUTES/VARIABLE_VALUE'
OBJECT_GRAPH_KEY = '_CHECKPOINTABLE_OBJECT_GRAPH'
_WRITERS = 4  # concurrent shard writers per client (2-4 measured best on 2 cores)
_PART = re.compile(r'^(part-c\d+-\d+)\.index$')

# A shard's extent: (start, length) per dimension of the global tensor.
Ranges = tuple[tuple[int, int], ...]


@dataclasses.dataclass(frozen=True)
class CheckpointEntry:
  """One checkpoint key and where its value lives.

  `index` None: the key holds the whole `variable`. `index` (i, j, ...): the
  key holds `variable[i, j, ...]` (one element of a stacked variable)."""
  key: str
  variable: object  # tf.Variable or DVariable
  index: tuple[int, ...] | None = None

  @property
  def shape(self) -> tuple[int, ...]:
    shape = tuple(self.variable.shape.as_list())
    return shape if self.index is None else shape[len(self.index):]


def escape(name: str) -> str:
  """A trackable child name as tf.train.Checkpoint spells it in keys."""
  return name.replace('.', '..').replace('/', '.S')


def _children(obj) -> Mapping[str, object]:
  return obj._trackable_children(save_type='checkpoint')  # pylint: disable=protected-access


def checkpoint_entries(state: Mapping[str, object]) -> list[CheckpointEntry]:
  """An entry per variable reachable from `state`, keyed as tf.train.Checkpoint
  keys it (`model/stack/block_000/ffn/w_in/.ATTRIBUTES/VARIABLE_VALUE`); a
  variable reachable twice keeps its first key."""
  entries: list[CheckpointEntry] = []
  seen: set[int] = set()

  def visit(prefix: str, obj) -> None:
    if isinstance(obj, tf.Variable):
      if id(obj) not in seen:
        seen.add(id(obj))
        unstacked = unstacked_pieces(obj)
        if unstacked is None:
          entries.append(CheckpointEntry(prefix + VALUE_SUFFIX, obj))
        else:
          placeholder, pieces = unstacked
          entries.extend(
              CheckpointEntry(unstacked_key(prefix, placeholder, name) + VALUE_SUFFIX,
                              obj, index) for name, index in pieces)
      return
    for name, child in _children(obj).items():
      visit(f'{prefix}/{escape(name)}', child)

  for name, obj in state.items():
    visit(escape(name), obj)
  return entries


def object_graph(state: Mapping[str, object], *, omit: Collection[str] = ()) -> bytes:
  """The serialized object graph tf.train.Checkpoint stores with its values,
  so `tf.train.Checkpoint(...).read()` can match objects, not just keys. Built
  with the same traversal as `checkpoint_entries`, so the keys agree; the
  variables keyed in `omit` (not in the checkpoint) get no value attribute."""
  from tensorflow.core.protobuf import trackable_object_graph_pb2  # pylint: disable=g-import-not-at-top
  graph = trackable_object_graph_pb2.TrackableObjectGraph()
  node_of: dict[int, int] = {}

  def add(obj, prefix: str) -> int:
    if id(obj) in node_of:
      return node_of[id(obj)]
    node_id = len(graph.nodes)
    node_of[id(obj)] = node_id
    node = graph.nodes.add()
    if isinstance(obj, tf.Variable):
      if unstacked_pieces(obj) is not None or prefix + VALUE_SUFFIX in omit:
        return node_id  # keys that are the unstacked ones, or none here: none to name
      attribute = node.attributes.add()
      attribute.name = 'VARIABLE_VALUE'
      attribute.full_name = obj.name.split(':')[0]
      attribute.checkpoint_key = prefix + VALUE_SUFFIX
      return node_id
    for name, child in _children(obj).items():
      child_id = add(child, f'{prefix}/{escape(name)}' if prefix else escape(name))
      reference = graph.nodes[node_id].children.add()
      reference.node_id, reference.local_name = child_id, name
    return node_id

  root = graph.nodes.add()
  node_of[-1] = 0
  for name, obj in state.items():
    child_id = add(obj, escape(name))
    reference = root.children.add()
    reference.node_id, reference.local_name = child_id, name
  return graph.SerializeToString()


# -- where each shard lives ----------------------------------------------------------
def _layout(variable):
  return getattr(variable, 'layout', None)


def device_ranges(shape: Sequence[int], layout) -> list[Ranges]:
  """The extent of every device's shard, in the mesh's global device order."""
  mesh = layout.mesh
  axes = dict(zip(mesh.dim_names, mesh.shape()))
  result = []
  for position in range(mesh.size):
    location = dict(zip(mesh.dim_names, np.unravel_index(position, mesh.shape())))
    ranges = []
    for size, axis in zip(shape, layout.sharding_specs):
      if axis == UNSHARDED:
        ranges.append((0, size))
      else:
        length = size // axes[axis]
        ranges.append((int(location[axis]) * length, length))
    result.append(tuple(ranges))
  return result


def _entry_part(entry: CheckpointEntry, ranges: Ranges) -> tuple[Ranges, int | None] | None:
  """What a device whose shard spans `ranges` of the variable holds of `entry`:
  (the extent within the entry's tensor, the element of the shard to take), or None."""
  if entry.index is None:
    return ranges, None
  lead = ranges[:len(entry.index)]
  if not all(start <= i < start + length for i, (start, length) in zip(entry.index, lead)):
    return None
  return ranges[len(entry.index):], tuple(i - start for i, (start, _) in zip(entry.index, lead))


def slice_spec(shape: Sequence[int], ranges: Ranges) -> str:
  """The shape-and-slice string SaveV2/RestoreV2 take ('' for the whole tensor)."""
  if all(start == 0 and length == size for size, (start, length) in zip(shape, ranges)):
    return ''
  extents = ':'.join('-' if start == 0 and length == size else f'{start},{length}'
                     for size, (start, length) in zip(shape, ranges))
  return ' '.join(str(s) for s in shape) + ' ' + extents


def _local_positions(mesh) -> list[int]:
  """Global positions (row-major in the mesh) of this client's devices, in the
  order `dtensor.unpack` returns their components."""
  flat = list(np.asarray(mesh.global_device_ids()).reshape(-1))
  return [flat.index(device_id) for device_id in mesh.local_device_ids()]


# -- writing -------------------------------------------------------------------------
@dataclasses.dataclass
class _DeviceWrite:
  """What one device writes: names, slice specs and tensors for one SaveV2."""
  device: str
  names: list[str] = dataclasses.field(default_factory=list)
  specs: list[str] = dataclasses.field(default_factory=list)
  tensors: list = dataclasses.field(default_factory=list)

  def add(self, name: str, spec: str, tensor) -> None:
    self.names.append(name)
    self.specs.append(spec)
    self.tensors.append(tensor)


def snapshot(entries: Sequence[CheckpointEntry], *, client_id: int,
             object_graph_bytes: bytes | None = None) -> list[_DeviceWrite]:
  """This client's share of a save, grouped by the device that holds it.

  Each distinct slice is written by exactly one device in the whole cluster,
  chosen among the devices that hold it by a hash of key and slice, so copies
  of replicated shards spread the writing over devices and clients. Values
  are read, not copied: TF copies a variable's buffer before the next update
  writes into it, so the snapshot stays consistent while training goes on.
  """
  writes: dict[str, _DeviceWrite] = {}

  def on(device: str) -> _DeviceWrite:
    return writes.setdefault(device, _DeviceWrite(device))

  values: dict[int, list] = {}
  for entry in entries:
    variable = entry.variable
    layout = _layout(variable)
    if layout is None:
      if client_id == 0:
        value = variable.read_value()
        on(value.device).add(entry.key, '', value if entry.index is None else value[entry.index])
      continue
    if id(variable) not in values:
      values[id(variable)] = dtensor.unpack(variable.read_value())
    components = values[id(variable)]
    all_ranges = device_ranges(variable.shape.as_list(), layout)
    holders: dict[Ranges, list[int]] = {}
    for position, ranges in enumerate(all_ranges):
      part = _entry_part(entry, ranges)
      if part is not None:
        holders.setdefault(part[0], []).append(position)
    owner = {extent: positions[zlib.crc32(f'{entry.key} {extent}'.encode()) % len(positions)]
             for extent, positions in holders.items()}
    for local, position in enumerate(_local_positions(layout.mesh)):
      part = _entry_part(entry, all_ranges[position])
      if part is None or owner[part[0]] != position:
        continue
      extent, row = part
      component = components[local]
      on(component.device).add(entry.key, slice_spec(entry.shape, extent),
                               component if row is None else component[row])
  if object_graph_bytes is not None and client_id == 0:
    with tf.device('/CPU:0'):
      on('/CPU:0').add(OBJECT_GRAPH_KEY, '', tf.constant(object_graph_bytes))
  return list(writes.values())


def write_shards(writes: Sequence[_DeviceWrite], *, directory: str,
                 client_id: int) -> list[str]:
  """Writes each device's slices with one SaveV2 on that device (no copies to a
  host device) and fsyncs them; returns the part prefixes written
  (`part-c<client>-<n>`).

  The devices write at the same time, one thread each (SaveV2 and fsync run
  outside the GIL), so checksumming and copying one shard overlaps writing
  and syncing another. Each thread runs ops on its own device only: TF 2.21
  caches an eager op's wrapper function by op, attributes and device, and
  concurrent calls sharing one (as parallel reads did) mixed their inputs."""
  prefixes = [os.path.join(directory, f'part-c{client_id}-{n}') for n in range(len(writes))]
  if len(writes) <= 1:
    for prefix, shard in zip(prefixes, writes):
      write_part(prefix, shard)
    return prefixes
  # Leaving the pool waits for every writer, so when an error propagates no
  # writer is still creating files (a retry may then start afresh).
  with concurrent.futures.ThreadPoolExecutor(min(len(writes), _WRITERS),
                                             thread_name_prefix='shard-write') as pool:
    for done in [pool.submit(write_part, p, w) for p, w in zip(prefixes, writes)]:
      done.result()  # re-raises a writer's error
  return prefixes


def write_part(prefix: str, shard: _DeviceWrite) -> None:
  """One device's bundle at `prefix`, written on that device and fsynced."""
  with tf.device(shard.device):
    tf.raw_ops.SaveV2(prefix=prefix, tensor_names=shard.names,
                      shape_and_slices=shard.specs, tensors=shard.tensors)
  for suffix in ('.index', '.data-00000-of-00001'):
    with open(prefix + suffix, 'rb') as f:
      os.fsync(f.fileno())


def write_tensor_part(directory: str, number: int, key: str, value) -> None:
  """`value` (a whole tensor, on the host) as key `key` in part bundle
  `number` of `directory` (`part-c0-<number>`): a checkpoint streamed to disk
  one tensor at a time (an import), merged as a save's parts are."""
  with tf.device('/CPU:0'):
    shard = _DeviceWrite('/CPU:0')
    shard.add(key, '', tf.constant(value))
  write_part(os.path.join(directory, f'part-c0-{number}'), shard)


def find_parts(directory: str) -> list[str]:
  """Every part bundle in `directory` (all clients'), in a fixed order."""
  names = sorted(m.group(1) for m in map(_PART.match, os.listdir(directory)) if m)
  return [os.path.join(directory, name) for name in names]


def merge_parts(parts: Sequence[str], *, prefix: str) -> None:
  """Joins the part bundles into one checkpoint at `prefix`; the parts' data
  files are renamed into it and their indexes removed."""
  with tf.device('/CPU:0'):
    tf.raw_ops.MergeV2Checkpoints(checkpoint_prefixes=list(parts),
                                  destination_prefix=prefix, delete_old_dirs=False)


# -- reading -------------------------------------------------------------------------
def _restore(prefix: str, names: Sequence[str], specs: Sequence[str], dtypes, device: str):
  with tf.device(device):
    return tf.raw_ops.RestoreV2(prefix=prefix, tensor_names=list(names),
                                shape_and_slices=list(specs), dtypes=list(dtypes))


def read_entries(prefix: str, entries: Iterable[CheckpointEntry], *,
                 saved_dtypes: Mapping[str, object] | None = None) -> None:
  """Assigns every entry's variable from the checkpoint at `prefix`.

  Each local device reads only the slice it holds (a slice it shares with an
  earlier local device is read once); rows of a stacked variable are read
  from their own keys and stacked on the device. Works for any mesh shape or
  layout, whatever the layout the checkpoint was written from.

  `saved_dtypes` (key -> tf.DType): the checkpoint's, where they may differ
  from the variables' (a bfloat16 import read into float32 masters, a
  float32 base into a frozen bfloat16 or int8 one). A float tensor is read
  in its own dtype and cast on each device; read into an int8 variable, it
  is quantized on the mesh and the variable's scale set
  (`layout_core.model.frozen`).

  One variable at a time, in this thread: reading from several threads raced
  in TF 2.21's eager runtime (one call's tensor names met another call's slice
  specs), so the parallelism stays on the write side, where it was tested."""
  by_variable: dict[int, list[CheckpointEntry]] = {}
  for entry in entries:
    by_variable.setdefault(id(entry.variable), []).append(entry)
  saved_dtypes = saved_dtypes or {}
  for group in by_variable.values():
    variable = group[0].variable
    saved = tf.as_dtype(saved_dtypes.get(group[0].key, variable.dtype))
    value = _read_variable(prefix, group, saved)
    if variable.dtype == tf.int8 and saved.is_floating:
      from layout_core.model import frozen  # pylint: disable=g-import-not-at-top
      layout = _layout(variable)
      frozen.assign_quantized(variable, value if layout is None else dtensor.pack(value, layout))
    else:
      _assign(variable, value if saved == variable.dtype else _cast(value, variable.dtype))


def _read_variable(prefix: str, group: Sequence[CheckpointEntry], dtype):
  """The value of a variable without a layout, else the component of every
  local device, read in `dtype` (the checkpoint's)."""
  variable = group[0].variable
  rows = {e.index: e for e in group}
  whole = rows.get(None)
  shape = variable.shape.as_list()
  layout = _layout(variable)
  if layout is None:
    extent = tuple((0, s) for s in shape)
    return _read_extent(prefix, whole, rows, shape, extent, dtype, variable.device)
  all_ranges = device_ranges(shape, layout)
  cache: dict[Ranges, object] = {}
  components = []
  for device, position in zip(layout.mesh.local_devices(), _local_positions(layout.mesh)):
    ranges = all_ranges[position]
    if ranges not in cache:
      cache[ranges] = _read_extent(prefix, whole, rows, shape, ranges, dtype, device)
    components.append(cache[ranges])
  return components


def _assign(variable, value) -> None:
  layout = _layout(variable)
  variable.assign(value if layout is None else dtensor.pack(value, layout))


def _cast(value, dtype):
  """A value read by `_read_variable`, cast to `dtype` where it lies."""
  def cast(component):
    with tf.device(component.device):
      return tf.cast(component, dtype)
  return [cast(c) for c in value] if isinstance(value, list) else tf.cast(value, dtype)


def _read_extent(prefix, whole, rows, shape, ranges: Ranges, dtype, device: str):
  if whole is not None:
    return _restore(prefix, [whole.key], [slice_spec(shape, ranges)], [dtype], device)[0]
  depth = len(next(iter(rows)))
  lead = ranges[:depth]
  held_elements = list(itertools.product(*(range(start, start + length)
                                            for start, length in lead)))
  missing = [i for i in held_elements if i not in rows]
  if missing:
    raise ValueError(f'elements {missing} of a stacked variable have no checkpoint entry')
  specs = [slice_spec(shape[depth:], ranges[depth:])] * len(held_elements)
  values = _restore(prefix, [rows[i].key for i in held_elements], specs,
                    [dtype] * len(held_elements), device)
  with tf.device(device):
    stacked = tf.stack(values)
    return tf.reshape(stacked, [length for _, length in lead] + stacked.shape.as_list()[1:])


def checkpoint_keys(state: Mapping[str, tf.Module]) -> dict[str, tf.Variable]:
  """Checkpoint key -> variable for everything `state` would save (a stacked
  variable appears under each of its keys; `checkpoint_values` gives the slices)."""
  return {e.key: e.variable for e in checkpoint_entries(state)}


def checkpoint_values(state: Mapping[str, tf.Module]) -> dict[str, np.ndarray]:
  """Checkpoint key -> the value it would hold (on the host; tests, inspection)."""
  values, whole = {}, {}
  for entry in checkpoint_entries(state):
    if id(entry.variable) not in whole:
      whole[id(entry.variable)] = to_numpy(entry.variable)
    value = whole[id(entry.variable)]
    values[entry.key] = value if entry.index is None else value[entry.index]
  return values


def restore_values(prefix: str, keys: Mapping[str, tf.Variable]) -> None:
  """Assigns every variable from the checkpoint by key; each device reads its slice."""
  read_entries(prefix, [CheckpointEntry(k, v) for k, v in keys.items()])


def assign_global(variable: tf.Variable, value: np.ndarray) -> None:
  """Sets a (D)Variable from its global value; each device gets only its slice."""
  layout = getattr(variable, 'layout', None)
  variable.assign(pack_global_array(value, layout) if layout is not None else value)
