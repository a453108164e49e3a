"""Device meshes: named axes over real or virtual devices.

A `MeshSpec` is the plain description (ordered axis name -> size, device
type); `build_mesh` checks it against the machine and returns a DTensor mesh.
On CPU the logical devices a mesh needs are created automatically, which only
works before TensorFlow has initialised its devices:

    spec = MeshSpec(shape={'data': 2, 'model': 4})
    configure_virtual_cpus(spec.num_devices)   # before any TF op runs
    mesh = build_mesh(spec)                    # DTensor Mesh 'data'=2 x 'model'=4

`sub_meshes(mesh, 'stage')` cuts a mesh along one axis into the per-stage
meshes used by pipeline parallelism.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from typing import Mapping

import numpy as np

from layout_core import tf_internals
from layout_core.errors import ConfigError
from layout_core.fields import check_types
from layout_core.lazy import dtensor, tf
from layout_core.layout.rules import UNSHARDED  # dtensor.UNSHARDED

DEVICE_TYPES = ('CPU', 'GPU', 'TPU')


@dataclasses.dataclass(frozen=True)
class MeshSpec:
  """Axis names and sizes, in order (outermost first), and the device type."""
  shape: Mapping[str, int] = dataclasses.field(  # ordered {axis: size}; product = devices used
      default_factory=lambda: {'data': 8})
  device_type: str = 'CPU'  # one of DEVICE_TYPES
  # Declared memory of one device, in GiB: `launch.inspect`'s memory report says
  # whether the estimate fits in it, and `launch.inspect --suggest` takes it as
  # the default budget (on CPU times the devices of a process); None: not declared.
  device_memory_gb: float | None = None
  # Declared peak FLOP/s of one device: the `train/mfu` scalar is the model's
  # FLOP rate over this times the mesh's devices; None: not declared, no
  # `train/mfu`.
  peak_flops_per_device: float | None = None

  def __post_init__(self):
    check_types(self, name='mesh')
    shape = dict(self.shape)
    if not shape:
      raise ConfigError('mesh.shape is empty', where='mesh.shape',
                        fix="give at least one axis, e.g. {'data': 8}")
    for name, size in shape.items():
      if not name.isidentifier():
        raise ConfigError(f'mesh axis name {name!r} is not an identifier',
                          where='mesh.shape', fix="use names like 'data' or 'model'")
      if name == UNSHARDED:
        raise ConfigError(f"'{UNSHARDED}' is reserved and cannot name a mesh axis",
                          where='mesh.shape', fix="use names like 'data' or 'model'")
      if size < 1:
        raise ConfigError(f"mesh axis '{name}' has size {size}", where='mesh.shape',
                          fix='use a positive integer')
    if self.device_type.upper() not in DEVICE_TYPES:
      raise ConfigError(f'mesh.device_type {self.device_type!r} is unknown',
                        where='mesh.device_type',
                        fix=f'use one of {", ".join(DEVICE_TYPES)}')
    for field, example in (('device_memory_gb', '80'), ('peak_flops_per_device', '989e12')):
      value = getattr(self, field)
      if value is not None and not value > 0:
        raise ConfigError(f'mesh.{field} is {value}, but it must be positive',
                          where=f'mesh.{field}',
                          fix=f'give the per-device figure (e.g. {example}) or None')
    object.__setattr__(self, 'shape', shape)
    object.__setattr__(self, 'device_type', self.device_type.upper())

  @property
  def num_devices(self) -> int:
    return math.prod(self.shape.values())

  @property
  def axis_names(self) -> tuple[str, ...]:
    return tuple(self.shape)

  def describe(self) -> str:
    dims = 'x'.join(str(s) for s in self.shape.values())
    axes = ', '.join(f'{k}={v}' for k, v in self.shape.items())
    return f'{self.device_type} mesh {dims}={self.num_devices} ({axes})'


def configure_cpu_threads(local_devices: int) -> None:
  """With several logical CPU devices, one intra-op thread per core share.

  Every logical device runs its kernels on the process's one intra-op pool
  (as many threads as cores by default); N devices running at once then
  oversubscribe the cores N times over. Measured on 2 cores, lm_small
  (bench/step_breakdown.py): `data=8` 478 -> 385 ms a step, `data=2 x model=4`
  430 -> 381 ms, with one thread; one device is faster with the default
  (253 vs 287 ms), so a one-device process keeps it. TF_NUM_INTRAOP_THREADS,
  when set, wins. Must run before TensorFlow initialises its devices."""
  if local_devices <= 1 or os.environ.get('TF_NUM_INTRAOP_THREADS'):
    return
  cores = len(os.sched_getaffinity(0)) if hasattr(os, 'sched_getaffinity') else os.cpu_count()
  try:
    tf.config.threading.set_intra_op_parallelism_threads(max(1, (cores or 1) // local_devices))
  except RuntimeError:
    pass  # already initialised: it keeps what it has


def configure_virtual_cpus(count: int) -> int:
  """Splits the physical CPU into `count` logical devices if TF allows it.

  Must run before TensorFlow initialises its devices. Returns the number of
  logical CPU devices now visible (more than `count` if an earlier call made
  more; fewer if TF was already initialised).
  """
  cpus = tf.config.list_physical_devices('CPU')
  configure_cpu_threads(count)
  try:
    existing = tf.config.get_logical_device_configuration(cpus[0]) or []
    if len(existing) < count:
      tf.config.set_logical_device_configuration(
          cpus[0], [tf.config.LogicalDeviceConfiguration()] * count)
  except RuntimeError:
    pass  # Already initialised: report what we have, the caller decides.
  return len(tf.config.list_logical_devices('CPU'))


def build_mesh(spec: MeshSpec) -> dtensor.Mesh:
  """A DTensor mesh for `spec`, or ConfigError if the machine is too small.

  In a multi-client run (after `cluster.connect`) the mesh spans every
  client's devices, client 0's first.

  First it settles what every function on it compiles with
  (`layout_core.tf_internals`): Grappler's memory optimizer off, on CPU
  only the Grappler passes that rewrite something, run once, and the
  process's all-gather lowering, decided by its first mesh (one axis:
  CollectiveGatherV2). A mesh of two or more axes in a process that chose
  CollectiveGatherV2 is a ConfigError: most of its relayouts would not
  compile."""
  tf_internals.keep_sums_whole()
  tf_internals.trim_graph_passes(spec.device_type)
  mesh = _distributed_mesh(spec) if dtensor.num_clients() > 1 else _local_mesh(spec)
  _settle_gather_lowering(spec)  # once the mesh is built: a mesh that failed decides nothing
  return mesh


def _local_mesh(spec: MeshSpec) -> dtensor.Mesh:
  if spec.device_type == 'CPU':
    available = configure_virtual_cpus(spec.num_devices)
  else:
    available = len(tf.config.list_logical_devices(spec.device_type))
  if available == 0 and spec.device_type != 'CPU':
    raise ConfigError(f'mesh.device_type is {spec.device_type!r}, but this machine has no '
                      f'{spec.device_type} devices', where='mesh.device_type',
                      fix="set mesh.device_type = 'CPU' (virtual CPU devices work anywhere)")
  if available < spec.num_devices:
    raise ConfigError(
        f'{spec.describe()} needs {spec.num_devices} devices but only '
        f'{available} {spec.device_type} devices are visible',
        where='mesh.shape',
        fix=f'shrink mesh.shape to at most {available} devices in total'
        + (' (virtual CPU devices can only be added before TensorFlow starts;'
           ' run in a fresh process)' if spec.device_type == 'CPU' else ''))
  devices = [f'{spec.device_type}:{i}' for i in range(spec.num_devices)]
  return dtensor.create_mesh(list(spec.shape.items()), devices=devices,
                             device_type=spec.device_type)


def _distributed_mesh(spec: MeshSpec) -> dtensor.Mesh:
  clients = dtensor.num_clients()
  local = dtensor.num_local_devices(spec.device_type)
  if local * clients != spec.num_devices:
    raise ConfigError(
        f'{spec.describe()} needs {spec.num_devices} devices but {clients} clients with '
        f'{local} {spec.device_type} devices each give {local * clients}',
        where='mesh.shape', fix='make mesh.shape the product of the client count and '
        'the devices per client (--devices_per_client for local CPU clusters)')
  return dtensor.create_distributed_mesh(list(spec.shape.items()),
                                         device_type=spec.device_type)


def _settle_gather_lowering(spec: MeshSpec) -> None:
  collective_gather, reason = tf_internals.lower_gathers_once(
      len(spec.shape) == 1, reason=f'its first mesh is {spec.describe()}')
  if collective_gather and len(spec.shape) > 1:
    raise ConfigError(
        f'{spec.describe()} has {len(spec.shape)} axes, but this process compiles DTensor '
        f'all-gathers to CollectiveGatherV2 ({reason}), which fails to compile most '
        'relayouts on a mesh of two or more axes (bench/limits/gather_lowering_limit.py)',
        where='mesh.shape',
        fix='build this mesh in a fresh process; a process that needs meshes of several '
        'shapes calls layout_core.tf_internals.lower_gathers_once(False, reason=...) '
        'before its first mesh')


def mesh_axes(mesh: dtensor.Mesh) -> dict[str, int]:
  return dict(zip(mesh.dim_names, mesh.shape()))


def describe_mesh(mesh: dtensor.Mesh) -> str:
  axes = mesh_axes(mesh)
  return MeshSpec(shape=axes, device_type=mesh.device_type()).describe()


def device_names(mesh: dtensor.Mesh) -> dict[int, str]:
  """Device id -> full device name, for every device of `mesh` on every client.

  A mesh made for several clients lists only this client's devices, unless
  it was given them all (`sub_meshes` does); the others are named from ours:
  client k holds ids k*L..(k+1)*L-1 in the same order (`create_distributed_mesh`)."""
  ids = [int(i) for i in np.asarray(mesh.global_device_ids()).flat]
  if mesh.global_devices():
    return dict(zip(ids, mesh.global_devices()))
  local = dict(zip((int(i) for i in mesh.local_device_ids()), mesh.local_devices()))
  if len(local) == len(ids):
    return local
  per_client, me = len(local), dtensor.client_id()
  names = {}
  for device_id, name in local.items():
    offset = device_id - me * per_client
    for client in range(len(ids) // per_client):
      names[client * per_client + offset] = _on_client(name, client)
  return names


def _on_client(device_name: str, client: int) -> str:
  """The same device (type and index) on another client's task."""
  return re.sub(r'/task:\d+/', f'/task:{client}/', device_name)


def client_of(device_name: str) -> int:
  """The client (task) of a full device name; 0 for a one-client name."""
  task = re.search(r'/task:(\d+)/', device_name)
  return int(task.group(1)) if task else 0


def describe_devices(mesh: dtensor.Mesh) -> str:
  """'CPU:0, CPU:1' for one client's mesh; with several, each client's own:
  'client 0: CPU:0, CPU:1; client 1: CPU:0, CPU:1'."""
  per_client: dict[int, list[str]] = {}
  for _, device in sorted(device_names(mesh).items()):
    per_client.setdefault(client_of(device), []).append(device.rsplit('/', 1)[-1])
  if len(per_client) == 1:
    return ', '.join(next(iter(per_client.values())))
  return '; '.join(f'client {c}: {", ".join(names)}' for c, names in per_client.items())


def sub_meshes(mesh: dtensor.Mesh, axis: str) -> list[dtensor.Mesh]:
  """Cuts `mesh` along `axis` into one mesh per index, keeping the other axes.

  Devices 0..7 on {'stage': 2, 'data': 4} give [devices 0-3, devices 4-7].

  On a mesh of several clients, sub-mesh k is not the devices at index k of
  `axis` (that would put each stage on its own client, and DTensor cannot
  copy between meshes on different hosts: bench/limits/cross_client_submesh_limit.py)
  but the k-th equal share of every client's devices, client 0's first: on 2
  clients x 4, stage 0 = CPU 0-1 of both clients, stage 1 = CPU 2-3 of both.
  The other axes keep their order over those devices, so the outermost one
  spans the clients.
  """
  axes = mesh_axes(mesh)
  if axis not in axes:
    raise ConfigError(f"mesh has no axis '{axis}' (axes: {', '.join(axes)})")
  rest = [(name, size) for name, size in axes.items() if name != axis]
  if not rest:
    rest = [('replica', 1)]
  devices = mesh.local_devices()
  if len(devices) != mesh.size:
    return _shares_of_every_client(mesh, axis, rest)
  locations = mesh.local_device_locations()
  result = []
  for index in range(axes[axis]):
    chosen = [d for d, loc in zip(devices, locations) if loc[axis] == index]
    result.append(dtensor.create_mesh(
        rest, devices=chosen, device_type=mesh.device_type(),
        mesh_name=f'{axis}{index}'))
  return result


def _shares_of_every_client(mesh: dtensor.Mesh, axis: str,
                            rest: list[tuple[str, int]]) -> list[dtensor.Mesh]:
  """`sub_meshes` of a multi-client mesh (see there)."""
  count, local = mesh_axes(mesh)[axis], mesh.local_devices()
  clients, me = dtensor.num_clients(), dtensor.client_id()
  if len(local) % count:
    raise ConfigError(
        f"the {count} sub-meshes along '{axis}' each take an equal share of every "
        f"client's devices, and {len(local)} devices per client do not split {count} ways",
        where='mesh.shape',
        fix=f"run on clients with a multiple of {count} devices each, or fewer clients")
  share = len(local) // count
  result = []
  for k in range(count):
    devices = [_on_client(local[i], c)
               for c in range(clients) for i in range(k * share, (k + 1) * share)]
    ids = list(range(len(devices)))
    mine = [i for i in ids if i // share == me]
    result.append(dtensor.Mesh([n for n, _ in rest], np.array(ids).reshape([s for _, s in rest]),
                               mine, [devices[i] for i in mine], f'{axis}{k}',
                               global_devices=devices))
  return result


# DTensor folds the value of a small function input (17 elements or fewer
# measured; 24 or more are not) into its compile cache key: the first call
# with another value compiles the whole function again, after which DTensor
# stops folding that input (bench/limits/small_input_recompile.py). A scalar that
# changes from call to call (a step, a seed, a norm) travels as this many
# copies; the function reads [0].
UNFOLDED_LENGTH = 64


def pack_changing_scalar(value, mesh: dtensor.Mesh) -> tf.Tensor:
  """`value` (a NumPy scalar) replicated on `mesh` as UNFOLDED_LENGTH copies."""
  return pack_global_array(np.full([UNFOLDED_LENGTH], value),
                           dtensor.Layout.replicated(mesh, 1))


def pack_global_array(array, layout: dtensor.Layout) -> tf.Tensor:
  """A DTensor holding `array` (the global value) with `layout`.

  Each local device gets only its own slice, so in a multi-client run every
  client packs just the shards its devices own.
  """
  axes = mesh_axes(layout.mesh)
  for dim, axis in enumerate(layout.sharding_specs):
    if axis != UNSHARDED and array.shape[dim] % axes[axis]:
      raise ConfigError(f'dimension {dim} of a {list(array.shape)} array does not split '
                        f"evenly over mesh axis '{axis}' of size {axes[axis]}",
                        fix=f'make that dimension a multiple of {axes[axis]}')
  shards = []
  for location in layout.mesh.local_device_locations():
    index = []
    for dim, axis in enumerate(layout.sharding_specs):
      if axis == UNSHARDED:
        index.append(slice(None))
        continue
      step = array.shape[dim] // axes[axis]
      start = step * location[axis]
      index.append(slice(start, start + step))
    shards.append(tf.constant(array[tuple(index)]))
  return dtensor.pack(shards, layout)
