"""Several processes ("clients") as one DTensor mesh, on TF's own runtime.

Every client runs the same program with the same config; DTensor's
multi-client runtime (gRPC between the clients, a coordination service on
client 0) makes their devices one global mesh, and the collectives DTensor
inserts run across processes. This module only sets that runtime up and adds
what it lacks: a bounded start (TF's own start blocks forever, holding the
GIL and ignoring SIGTERM, when a peer never comes up) and two small
collectives the checkpointer needs, plus `exchange` (strings between the
clients, through the coordination service's key-value store).

    spec = ClusterSpec(client_id=1, addresses=('h0:9000', 'h1:9000'))
    connect(spec, device_type='CPU', num_local_devices=4)   # returns once all joined
    mesh = build_mesh(MeshSpec(shape={'data': 2, 'model': 4}))  # spans both clients
    coordinator = MeshCoordinator(mesh, spec)
    coordinator.gather(3)     # [value of client 0, value of client 1]: also a barrier

Clients need a shared filesystem for checkpoints (docs/several-hosts.md).
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from typing import Mapping, Sequence

import numpy as np

from layout_core import tf_internals
from layout_core.errors import ConfigError
from layout_core.layout import scheduler
from layout_core.lazy import dtensor, tf

ENV_CLIENT_ID = 'DTENSOR_CLIENT_ID'
ENV_JOBS = 'DTENSOR_JOBS'
ENV_JOB_NAME = 'DTENSOR_JOB_NAME'
JOB_NAME = 'worker'


@dataclasses.dataclass(frozen=True)
class ClusterSpec:
  """Which client this process is, and every client's host:port (client order)."""
  client_id: int = 0                  # this process's index into `addresses`
  addresses: tuple[str, ...] = ()     # host:port per client; () for a single process
  init_timeout: float = 120.0         # seconds to wait for every client to join
  source: str = ''                    # '' (given by hand), 'slurm' or 'tf_config'

  def __post_init__(self):
    object.__setattr__(self, 'addresses', tuple(self.addresses))
    if self.addresses and not 0 <= self.client_id < len(self.addresses):
      raise ConfigError(f'client_id {self.client_id} is not in 0..{len(self.addresses) - 1}',
                        where='--client_id', fix='number the clients 0..num_clients-1')
    for address in self.addresses:
      host, _, port = address.rpartition(':')
      if not host or not port.isdigit():
        raise ConfigError(f'cluster address {address!r} is not host:port', where='--cluster',
                          fix='give every client as host:port, e.g. 10.0.0.1:9000')
    if list(self.addresses) != sorted(self.addresses):
      raise ConfigError(
          f'the cluster list {",".join(self.addresses)} is not in sorted order; DTensor '
          'numbers clients by the sorted list, so client ids would not match',
          where='--cluster', fix='order the clients so that the list is sorted as '
          'strings (give ports the same number of digits), and number them in that order')
    if len(set(self.addresses)) != len(self.addresses):
      raise ConfigError(f'the cluster list {",".join(self.addresses)} repeats an address',
                        where='--cluster', fix='give each client its own host:port')
    if self.init_timeout <= 0:
      raise ConfigError(f'cluster_init_timeout is {self.init_timeout}',
                        where='--cluster_init_timeout', fix='use a positive number of seconds')

  @property
  def num_clients(self) -> int:
    return max(1, len(self.addresses))

  @property
  def is_multi_client(self) -> bool:
    return self.num_clients > 1

  @property
  def under_scheduler(self) -> bool:
    """Started by a scheduler, which requeues a run that exits EXIT_REQUEUE."""
    return bool(self.source)

  def describe(self) -> str:
    if not self.is_multi_client:
      return 'single client' + (f' (from {self.source})' if self.source else '')
    return (f'client {self.client_id} of {self.num_clients} ({",".join(self.addresses)}'
            f'{", from " + self.source if self.source else ""})')

  @classmethod
  def from_options(cls, *, client_id: int | None, num_clients: int | None,
                   cluster: Sequence[str], init_timeout: float, port: int | None = None,
                   environ: Mapping[str, str] | None = None) -> 'ClusterSpec':
    """From launcher flags: `cluster` is a host:port list, or ['slurm'] /
    ['tf_config'] (the scheduler's environment decides; --client_id and
    --num_clients, if given, must agree with it), or empty (the standard
    DTENSOR_* environment variables, else a single process)."""
    environ = os.environ if environ is None else environ
    addresses = [a for a in cluster if a]
    if port is not None and addresses != [scheduler.SLURM]:
      raise ConfigError(f'--cluster_port={port} is only for --cluster=slurm',
                        where='--cluster_port',
                        fix='leave it out: --cluster lists the ports, TF_CONFIG names them')
    if len(addresses) == 1 and addresses[0] in scheduler.SOURCES:
      return cls._from_scheduler(addresses[0], client_id=client_id, num_clients=num_clients,
                                 init_timeout=init_timeout, port=port, environ=environ)
    scheduler.check_cluster_list(addresses)  # a typo ('slurmm') is no single process
    if not addresses and environ.get(ENV_JOBS):
      addresses = [a for a in environ[ENV_JOBS].split(',') if a]
    if not addresses:
      why = scheduler.unclaimed_slurm_step(environ)
      if why:
        raise ConfigError(why, where='--cluster',
                          fix='add --cluster=slurm so that the tasks train one model together '
                              '(or run one task: srun -n 1)')
    if client_id is None:
      text = environ.get(ENV_CLIENT_ID, '0')
      if not text.isdigit():
        raise ConfigError(f'{ENV_CLIENT_ID}={text!r} is not a client number',
                          where=ENV_CLIENT_ID, fix='set it to 0..num_clients-1')
      client_id = int(text)
    if num_clients is not None and num_clients != max(1, len(addresses)):
      raise ConfigError(
          f'--num_clients={num_clients} but the cluster list names {len(addresses)} '
          f'client(s) ({",".join(addresses) or "none"})', where='--cluster',
          fix='give one host:port per client in --cluster (or DTENSOR_JOBS)')
    if len(addresses) == 1:
      addresses = []
    return cls(client_id=client_id, addresses=tuple(addresses), init_timeout=init_timeout)

  @classmethod
  def _from_scheduler(cls, source: str, *, client_id: int | None, num_clients: int | None,
                      init_timeout: float, port: int | None,
                      environ: Mapping[str, str]) -> 'ClusterSpec':
    given_id, addresses = scheduler.cluster_from_scheduler(source, environ=environ, port=port)
    count = max(1, len(addresses))
    for flag, value, expected in (('--client_id', client_id, given_id),
                                  ('--num_clients', num_clients, count)):
      if value is not None and value != expected:
        raise ConfigError(
            f'{flag}={value} but {source} makes this client {given_id} of {count} '
            f'({",".join(addresses) or "a single process"})', where=flag,
            fix=f'leave {flag} out with --cluster={source}: the scheduler decides')
    return cls(client_id=given_id, addresses=tuple(addresses), init_timeout=init_timeout,
               source=source)


# The watchdog is a separate process: while DTensor's start blocks it holds the
# GIL, so no Python thread of ours could run, and SIGTERM is caught by TF.
_WATCHDOG = r'''
import os, select, signal, socket, sys
parent, timeout, client, addresses = int(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3]), sys.argv[4].split(',')
ready, _, _ = select.select([sys.stdin], [], [], timeout)
if ready:
    sys.exit(0)  # the parent joined the cluster (or died: EOF)
silent = []
for peer, address in enumerate(addresses):
    if peer == client:
        continue
    host, _, port = address.rpartition(':')
    try:
        socket.create_connection((host, int(port)), timeout=2).close()
    except OSError:
        silent.append(f'client {peer} ({address})')
who = ('not listening: ' + ', '.join(silent)) if silent else 'every peer is listening but the cluster did not form'
sys.stderr.write(f'\nCluster error: client {client} gave up after {timeout:g} s waiting for '
                 f'the other clients of {",".join(addresses)} to join ({who}). Start every '
                 f'client with the same --cluster list, or raise --cluster_init_timeout.\n')
sys.stderr.flush()
os.kill(parent, signal.SIGKILL)
'''


def connect(spec: ClusterSpec, *, device_type: str, num_local_devices: int) -> None:
  """Joins the cluster: this client's devices become part of the global mesh.

  Returns when every client has joined; if that takes longer than
  `spec.init_timeout`, a watchdog process prints which peers never came up
  and kills this process (exit status -9 / 137)."""
  if not spec.is_multi_client:
    return
  os.environ[ENV_CLIENT_ID] = str(spec.client_id)
  os.environ[ENV_JOB_NAME] = JOB_NAME
  os.environ[ENV_JOBS] = ','.join(spec.addresses)
  os.environ.pop('DTENSOR_NUM_CLIENTS', None)
  watchdog = subprocess.Popen(
      [sys.executable, '-c', _WATCHDOG, str(os.getpid()), str(spec.init_timeout),
       str(spec.client_id), ','.join(spec.addresses)], stdin=subprocess.PIPE,
      stderr=sys.stderr)  # Python's stderr: it outlives this process (a filtered fd 2 may not)
  if device_type == 'CPU':
    from layout_core.layout.mesh import configure_cpu_threads  # pylint: disable=g-import-not-at-top
    configure_cpu_threads(num_local_devices)
  try:
    kwargs = {'num_logical_cpu_devices': num_local_devices} if device_type == 'CPU' else {}
    dtensor.initialize_accelerator_system(device_type, **kwargs)
  finally:
    watchdog.stdin.write(b'ok')
    watchdog.stdin.close()
    watchdog.wait()


def exchange(spec: ClusterSpec, *, key: str, value: str, timeout: float) -> list[str]:
  """Every client's `value` for `key`, in client order, through the key-value
  store of TF's coordination service (which DTensor's multi-client start
  runs on client 0). Call after `connect`, with the same key on every client;
  a peer that never posts its value is a TimeoutError after `timeout` s."""
  if not spec.is_multi_client:
    return [value]
  tf_internals.put_key_value(f'meshgin/{key}/{spec.client_id}', value)
  values = []
  for client in range(spec.num_clients):
    try:
      values.append(tf_internals.get_key_value(f'meshgin/{key}/{client}', timeout_s=timeout))
    except tf.errors.OpError as e:
      raise TimeoutError(f'client {client} did not post {key!r} within {timeout:g} s: '
                         f'{str(e).splitlines()[0]}') from None
  return values


def settle_before_leaving(spec: ClusterSpec, *, key: str, timeout: float) -> None:
  """Call on every client once all have read, through `exchange`, something
  that ends the run on each of them (e.g. settings that differ). Client 0
  hosts the coordination service and its exit ends it, so a peer still
  reading would fail with a lost-peer error instead of the reason: each other
  client posts that it has read (and goes on if the post fails: it needs the
  service no more), and client 0 waits up to `timeout` s for all of them."""
  if not spec.is_multi_client:
    return
  if spec.client_id:
    try:
      tf_internals.put_key_value(f'meshgin/{key}/read/{spec.client_id}', '')
    except tf.errors.OpError:
      pass
    return
  for client in range(1, spec.num_clients):
    try:
      tf_internals.get_key_value(f'meshgin/{key}/read/{client}', timeout_s=timeout)
    except tf.errors.OpError:
      return  # that peer is gone or stuck: waiting longer helps no one


class SingleClient:
  """The coordinator of a one-process run: nothing to agree with."""
  client_id = 0
  num_clients = 1

  def gather(self, value: float) -> list[float]:
    return [value]

  def gather_text(self, key: str, value: str) -> list[str]:
    del key
    return [value]

  def barrier(self) -> None:
    pass

  def settle_before_leaving(self, key: str, timeout: float | None = None) -> None:
    del key, timeout


class MeshCoordinator:
  """Small agreements between the clients of one mesh, as DTensor collectives.

  Every client must call the same methods in the same order (they are
  collectives); call them from the main thread, between training steps."""

  def __init__(self, mesh, spec: ClusterSpec):
    self.mesh, self.spec = mesh, spec
    self._text_calls = 0
    self.client_id = spec.client_id
    self.num_clients = spec.num_clients
    rank = len(mesh.dim_names)
    self._layout = dtensor.Layout(list(mesh.dim_names) + [dtensor.UNSHARDED], mesh)
    self._shard_shape = [1] * rank + [self.num_clients]
    self._reduce = tf.function(lambda x: tf.reduce_sum(x, axis=list(range(rank))))

  def gather(self, value: float) -> list[float]:
    """Every client's `value`, in client order. Also a barrier."""
    mine = np.zeros(self._shard_shape, np.float64)
    mine[..., self.client_id] = value  # from this client's first device only
    shards = []
    for number, device in enumerate(self.mesh.local_devices()):
      with tf.device(device):
        shards.append(tf.constant(mine if number == 0 else np.zeros_like(mine)))
    total = self._reduce(dtensor.pack(shards, self._layout))
    return [float(v) for v in dtensor.unpack(total)[0].numpy()]

  def gather_text(self, key: str, value: str, timeout: float = 600.0) -> list[str]:
    """Every client's text `value`, in client order, through the coordination
    service's key-value store (`key` names the exchange; made unique per call)."""
    self._text_calls += 1
    return exchange(self.spec, key=f'{key}/{self._text_calls}', value=value, timeout=timeout)

  def barrier(self) -> None:
    self.gather(0.0)

  def settle_before_leaving(self, key: str, timeout: float | None = None) -> None:
    """`settle_before_leaving` (the module function): after a collective
    that ends the run on every client, client 0 leaves last, waiting up to
    `timeout` s (default: the cluster's join timeout)."""
    settle_before_leaving(self.spec, key=key, timeout=timeout or self.spec.init_timeout)


def coordinator_for(mesh, spec: ClusterSpec | None):
  if spec is None or not spec.is_multi_client:
    return SingleClient()
  return MeshCoordinator(mesh, spec)
