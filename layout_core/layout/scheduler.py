"""The cluster a scheduler gave this process: Slurm's variables, or TF_CONFIG.

    spec = cluster_from_scheduler('slurm', environ=os.environ)   # under srun
    spec.client_id, spec.addresses                   # this task, every task's host:port

A scheduler starts every task of a job with the same command; each task finds
its peers and its own place in its environment:

* **Slurm** (`srun`, or `srun` inside an `sbatch` script): the step's node
  list and tasks per node give every task's host; each task on a node gets
  `port + SLURM_LOCALID`, where `port` defaults to a block picked from the job
  id (`job_port`: two jobs sharing a node do not collide, and the block lies
  below the kernel's ephemeral ports, which outgoing connections take). This
  task's node name (`SLURMD_NODENAME`) must resolve. The node list is expanded by
  Slurm's own `scontrol show hostnames`. TensorFlow's `SlurmClusterResolver`
  is not used: it assigns task ranks to hosts by packing the sorted host list,
  which names the wrong host for a task under `srun --distribution=cyclic`, and
  it needs GPU counts on CPU-only nodes. Only addresses are needed here.
* **TF_CONFIG** (Kubernetes training operators, Vertex AI, ...): its
  `cluster` lists the `chief` and `worker` addresses and its `task` says which
  one this process is.

DTensor numbers clients by the sorted address list, so a task's client id is
its address's place in that order (client 0 writes the run record and commits
checkpoints), not its Slurm rank or TF_CONFIG index.

Nothing here imports TensorFlow: a task outside an allocation fails at once.
"""

from __future__ import annotations

import difflib
import json
import re
import socket
import subprocess
from typing import Mapping, Sequence

from layout_core.errors import ConfigError

SLURM, TF_CONFIG = 'slurm', 'tf_config'
SOURCES = (SLURM, TF_CONFIG)
# Ports picked from the job id lie in [FIRST_PORT, END_PORT): below Linux's
# ephemeral range (ip_local_port_range, 32768-60999 by default), from which the
# kernel picks the local port of every outgoing connection, so no connection on
# the node can hold a port a task is about to listen on.
FIRST_PORT, END_PORT = 12000, 32000
PORTS_PER_JOB = 16   # a block per job id: up to 16 tasks per node without overlap
TF_CONFIG_TASK_TYPES = ('chief', 'worker')  # 'master' is read as 'chief'


def job_port(job_id: int) -> int:
  """The first port of the job's block (module doc): in [FIRST_PORT, END_PORT)."""
  return FIRST_PORT + job_id % ((END_PORT - FIRST_PORT) // PORTS_PER_JOB) * PORTS_PER_JOB


def check_cluster_list(values: Sequence[str]) -> None:
  """ConfigError unless --cluster's `values` are host:port addresses (the one
  scheduler name, e.g. ['slurm'], is taken before this is asked)."""
  for value in values:
    host, _, port = value.rpartition(':')
    if host and port.isdigit():
      continue
    close = difflib.get_close_matches(value.lower(), SOURCES, n=1)
    raise ConfigError(
        f'--cluster={",".join(values)}: {value!r} is neither a scheduler '
        f'({", ".join(SOURCES)}) nor a host:port address'
        + (f' (did you mean {close[0]!r}?)' if close else ''), where='--cluster',
        fix=f'give --cluster={" or --cluster=".join(SOURCES)}, or every client\'s host:port '
            '(e.g. --cluster=10.0.0.1:9000,10.0.0.2:9000), or leave it out to train in one '
            'process')


def check_resolves(host: str, *, where: str) -> None:
  """ConfigError unless `host` resolves: a name that does not would leave
  the cluster waiting for a client its peers can never reach."""
  try:
    socket.getaddrinfo(host, None)
  except (OSError, UnicodeError) as e:
    raise ConfigError(f'{where}={host!r} does not resolve to an address '
                      f'({getattr(e, "strerror", None) or e}), so the other tasks could not '
                      'reach this one', where=where,
                      fix='make every node\'s Slurm node name resolve on every node (DNS or '
                          '/etc/hosts), or give --cluster every client\'s address as '
                          'host:port') from None


def expand_tasks_per_node(text: str) -> list[int]:
  """Slurm's compressed tasks-per-node list: '2(x3),1' -> [2, 2, 2, 1]."""
  counts = []
  for part in text.split(','):
    match = re.fullmatch(r'(\d+)(?:\(x(\d+)\))?', part.strip())
    if not match:
      raise ConfigError(f'SLURM_STEP_TASKS_PER_NODE={text!r} is not a Slurm task count list',
                        where='SLURM_STEP_TASKS_PER_NODE',
                        fix='start the tasks with srun, which sets it')
    counts += [int(match.group(1))] * int(match.group(2) or 1)
  return counts


def expand_hostlist(text: str) -> list[str]:
  """Slurm's compressed node list ('node[01-03],gpu7'), expanded by Slurm itself."""
  try:
    result = subprocess.run(['scontrol', 'show', 'hostnames', text], capture_output=True,
                            text=True, timeout=60)
  except FileNotFoundError:
    raise ConfigError('scontrol is not on this node\'s PATH, so the Slurm node list '
                      f'{text!r} cannot be expanded', where='--cluster=slurm',
                      fix='run on a node of the Slurm cluster, with its commands on PATH') from None
  hosts = result.stdout.split()
  if result.returncode != 0 or not hosts:
    raise ConfigError(f'scontrol could not expand the node list {text!r}: '
                      f'{result.stderr.strip()}', where='SLURM_STEP_NODELIST',
                      fix='start the tasks with srun, which sets it')
  return hosts


def _job_summary(environ: Mapping[str, str]) -> str:
  shown = ('SLURM_JOB_ID', 'SLURM_NTASKS', 'SLURM_STEP_NUM_TASKS', 'SLURM_STEP_NODELIST',
           'SLURM_STEP_TASKS_PER_NODE', 'SLURM_PROCID')
  return ', '.join(f'{name}={environ[name]}' for name in shown if name in environ) or 'none'


def from_slurm(environ: Mapping[str, str], *, port: int | None = None) -> tuple[int, list[str]]:
  """(client id, every task's host:port) for this Slurm task (module doc)."""
  if 'SLURM_JOB_ID' not in environ:
    raise ConfigError(
        '--cluster=slurm but this process is not inside a Slurm allocation (no SLURM_JOB_ID '
        'is set)', where='--cluster=slurm',
        fix='start it with srun (or srun inside an sbatch script), or leave --cluster out '
            'to train in one process')
  if 'SLURM_STEP_NUM_TASKS' not in environ:  # the batch script itself, not a step
    tasks = int(environ.get('SLURM_NTASKS', '1') or 1)
    if tasks > 1:
      raise ConfigError(
          f'--cluster=slurm in the batch script of a {tasks}-task job, but not in a job step '
          f'(Slurm gave: {_job_summary(environ)})', where='--cluster=slurm',
          fix=f'start launch.train with srun inside the script, so that all {tasks} tasks run it')
    return 0, []
  if environ.get('SLURMD_NODENAME'):
    check_resolves(environ['SLURMD_NODENAME'], where='SLURMD_NODENAME')
  hosts = expand_hostlist(environ.get('SLURM_STEP_NODELIST', ''))
  counts = expand_tasks_per_node(environ.get('SLURM_STEP_TASKS_PER_NODE', ''))
  total = int(environ['SLURM_STEP_NUM_TASKS'])
  if len(hosts) != len(counts) or sum(counts) != total:
    raise ConfigError(
        f'the Slurm step\'s node list and task counts disagree (Slurm gave: '
        f'{_job_summary(environ)})', where='--cluster=slurm',
        fix='start launch.train with srun, one task per client')
  if port is None:
    port = job_port(int(environ['SLURM_JOB_ID']))
  addresses = [f'{host}:{port + local}' for host, count in zip(hosts, counts)
               for local in range(count)]
  mine = f'{environ.get("SLURMD_NODENAME", "")}:{port + int(environ.get("SLURM_LOCALID", 0))}'
  if mine not in addresses:
    raise ConfigError(f'this task\'s address {mine} is not in the step\'s node list '
                      f'{",".join(hosts)}', where='--cluster=slurm',
                      fix='start launch.train with srun (it sets SLURMD_NODENAME and '
                          'SLURM_LOCALID)')
  return client_order(addresses, mine)


def from_tf_config(environ: Mapping[str, str]) -> tuple[int, list[str]]:
  """(client id, every task's host:port) from the TF_CONFIG environment variable."""
  text = environ.get('TF_CONFIG')
  example = ('e.g. {"cluster": {"worker": ["w0:2222", "w1:2222"]}, '
             '"task": {"type": "worker", "index": 0}}')
  if not text:
    raise ConfigError('--cluster=tf_config but TF_CONFIG is not set', where='TF_CONFIG',
                      fix=f'set TF_CONFIG for every replica ({example}); a training '
                          'operator sets it for you')
  try:
    config = json.loads(text)
    cluster, task = dict(config['cluster']), dict(config['task'])
    kind, index = ('chief' if task['type'] == 'master' else task['type']), int(task['index'])
  except (ValueError, KeyError, TypeError) as e:
    raise ConfigError(f'TF_CONFIG is not a cluster and task ({type(e).__name__}: {e}): '
                      f'{text[:200]}', where='TF_CONFIG', fix=example) from None
  cluster = {('chief' if name == 'master' else name): list(hosts)
             for name, hosts in cluster.items()}
  other = sorted(set(cluster) - set(TF_CONFIG_TASK_TYPES))
  if other or kind not in TF_CONFIG_TASK_TYPES:
    raise ConfigError(
        f'TF_CONFIG has task type(s) {", ".join(other or [kind])}: meshgin runs every replica '
        'as a client of one mesh, with no parameter servers or side-car evaluator',
        where='TF_CONFIG', fix='give the job only chief and worker replicas')
  members = cluster.get(kind, [])
  if not 0 <= index < len(members):
    raise ConfigError(f'TF_CONFIG\'s task is {kind} {index} but the cluster lists '
                      f'{len(members)} {kind} address(es)', where='TF_CONFIG', fix=example)
  addresses = [a for name in TF_CONFIG_TASK_TYPES for a in cluster.get(name, [])]
  return client_order(addresses, members[index])


def client_order(addresses: Sequence[str], mine: str) -> tuple[int, list[str]]:
  """The sorted address list (DTensor's client order) and `mine`'s place in it
  (a repeated address is refused by `ClusterSpec` itself)."""
  ordered = sorted(addresses)
  if len(ordered) == 1:
    return 0, []
  return ordered.index(mine), ordered


def cluster_from_scheduler(source: str, *, environ: Mapping[str, str],
                           port: int | None = None) -> tuple[int, list[str]]:
  if source == SLURM:
    return from_slurm(environ, port=port)
  if source == TF_CONFIG:
    return from_tf_config(environ)
  raise ValueError(f'unknown scheduler {source!r}; one of {SOURCES}')


def unclaimed_slurm_step(environ: Mapping[str, str]) -> str | None:
  """Why a plain run (no --cluster) must not start here, or None: N > 1 tasks of
  one srun step would each train the whole model alone in one model_dir."""
  tasks = environ.get('SLURM_STEP_NUM_TASKS')
  if tasks and tasks.isdigit() and int(tasks) > 1:
    return (f'this is one of {tasks} tasks of a Slurm step, but --cluster is not set, so '
            'each task would train alone')
  return None


def restart_count(environ: Mapping[str, str]) -> int | None:
  """How many times the scheduler restarted this job (Slurm's requeues), or None."""
  text = environ.get('SLURM_RESTART_COUNT')
  if text is not None and text.isdigit():
    return int(text)
  return 0 if 'SLURM_JOB_ID' in environ else None
