r"""Limit check: can a tensor move between sub-meshes that live on different clients?

The sub-mesh pipeline engine puts each stage on its own sub-mesh and moves
activations between stages with DTensor's cross-mesh copy. Across hosts, the
classic GPipe placement puts each stage's sub-mesh on its own client. This
starts 2 real clients (processes) of 4 logical CPU devices each, as
`launch.local_cluster` does, and in each one:

  1. builds the global mesh x=8 and the two stage sub-meshes by global device
     ids: stage 0 = devices 0-3 (all on client 0), stage 1 = devices 4-7 (on
     client 1); each client lists only its own devices as local;
  2. makes a [8, 16] value (3.0 everywhere) on stage 0 with an op (replicated, or sharded
     over x; every client runs the op, as every client runs the same program)
     and moves it to stage 1 in the same layout (as the sub-mesh engine moves
     activations) with `dtensor.copy_to_mesh` and with `dtensor.relayout`,
     eagerly and in a `tf.function`;
  3. checks the value that arrives on stage 1 (on client 1) and times out
     any variation that hangs.

Two other placements, for comparison: each stage on 2 devices of every
client ("within clients": stage 0 = client 0's CPU 0-1 and client 1's CPU
0-1), and both stages on client 0 ("one client", client 1 holding no device
of either; in one process the engine's crossings work, tests/test_pipeline.py).

Measured (TF 2.21, bench/results/cross_client_submesh.json):
* across clients, every variation fails to compile with DTensor's "Send and
  receive hosts don't match": its cross-mesh copy pairs only meshes that
  span the same hosts with the same shards on each;
* within clients, a replicated value moves right on both clients (eager and
  in a function, copy_to_mesh and relayout); a sharded one fails ("SPMD
  expansion resulted in op output inconsistent with the provided layout");
* one client: client 1 crashes (SIGSEGV); client 0 moves a replicated value
  right and fails on a sharded one as above.

    python bench/limits/cross_client_submesh_limit.py [--out bench/results/cross_client_submesh.json]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys

# The repository root (this file is bench/limits/<name>.py): bench.common, layout_core.
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)
from bench.common import RESULTS, write_json  # pylint: disable=wrong-import-position

_CLIENT = r'''
import json, os, sys, time
import numpy as np
import tensorflow as tf
from tensorflow.experimental import dtensor
client, placement, source_spec, move, compiled = (int(sys.argv[1]), sys.argv[2], sys.argv[3],
                                                  sys.argv[4], sys.argv[5] == 'function')
dtensor.initialize_accelerator_system('CPU', num_logical_cpu_devices=4)

def device(i):  # global device i: CPU i % 4 of client i // 4
  return f'/job:worker/replica:0/task:{i // 4}/device:CPU:{i % 4}'

def sub_mesh(name, ids, devices=None):  # a client may hold none of a mesh's devices
  devices = devices or [device(i) for i in ids]
  mine = [i for i, d in zip(ids, devices) if f'task:{client}/' in d]
  return dtensor.Mesh(['x'], np.array(ids), mine,
                      [d for d in devices if f'task:{client}/' in d], name,
                      global_devices=devices)

if placement == 'across clients':    # stage 0 on client 0, stage 1 on client 1
  source, target = sub_mesh('stage0', [0, 1, 2, 3]), sub_mesh('stage1', [4, 5, 6, 7])
elif placement == 'within clients':  # each stage on 2 devices of every client
  source = sub_mesh('stage0', [0, 1, 2, 3], [device(i) for i in (0, 1, 4, 5)])
  target = sub_mesh('stage1', [4, 5, 6, 7], [device(i) for i in (2, 3, 6, 7)])
else:                                # both stages on client 0's devices: 0-1 and 2-3
  source, target = sub_mesh('stage0', [0, 1]), sub_mesh('stage1', [2, 3])
value = np.full([8, 16], 3.0, np.float32)
layout = dtensor.Layout([source_spec, 'unsharded'], source)
# The activation keeps its layout across the stages, as the sub-mesh engine's does.
target_layout = dtensor.Layout([source_spec, 'unsharded'], target)

def make():  # the value made by an op on stage 0: every client runs it, as in SPMD
  # (tf.fill made directly in a sharded layout takes [8, 16] as the shard's shape)
  made = dtensor.call_with_layout(tf.fill, dtensor.Layout.replicated(source, 2), [8, 16], 3.0)
  return dtensor.relayout(made, layout)

def step(t):
  if move == 'copy_to_mesh':
    return dtensor.copy_to_mesh(t, target_layout)
  return dtensor.relayout(t, target_layout)

result = {'client': client}
try:
  x = make()
  y = tf.function(step)(x) if compiled else step(x)
  arrived = dtensor.unpack(y)
  if arrived:
    rows = 8 // (target.dim_size('x') if source_spec == 'x' else 1)
    result['same'] = all(np.array_equal(a.numpy(), value[:rows]) for a in arrived)
  result['ok'] = True
except Exception as e:  # pylint: disable=broad-except
  result['ok'] = False
  result['error'] = f'{type(e).__name__}: {" ".join(str(e).split())[:240]}'
print('RESULT ' + json.dumps(result), flush=True)
'''


def free_ports(count: int) -> list[int]:
  sockets = [socket.socket() for _ in range(count)]
  for s in sockets:
    s.bind(('localhost', 0))
  ports = sorted(s.getsockname()[1] for s in sockets)
  for s in sockets:
    s.close()
  return ports


def _short(error: str) -> str:
  """The message without DTensor's MLIR locations and source paths."""
  error = re.sub(r'loc\(fused\[.*?\]\): |<(unknown|string)>:[\d:]+: error: ', '', error)
  return error.split(' tensorflow/')[0][:160]


def run_clients(placement: str, spec: str, move: str, mode: str, timeout: float) -> dict:
  """Both clients of one variation: each one's outcome ('moved', 'moved, values
  right' / 'wrong values', the error, or how it died), or 'hung' after `timeout`."""
  jobs = ','.join(f'localhost:{p}' for p in free_ports(2))
  processes = []
  for client in (0, 1):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL='3', DTENSOR_CLIENT_ID=str(client),
               DTENSOR_JOBS=jobs, DTENSOR_JOB_NAME='worker')
    processes.append(subprocess.Popen(
        [sys.executable, '-c', _CLIENT, str(client), placement, spec, move, mode],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
  outcomes = {}
  for client, process in enumerate(processes):
    try:
      out, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
      for p in processes:
        p.kill()
      return {'client 0': f'hung ({timeout:g} s)', 'client 1': f'hung ({timeout:g} s)'}
    if 'RESULT ' in out:
      result = json.loads(out.split('RESULT ', 1)[1].splitlines()[0])
      if not result['ok']:
        outcomes[f'client {client}'] = _short(result['error'])
      elif 'same' in result:
        outcomes[f'client {client}'] = ('moved, values right' if result['same']
                                        else 'moved, wrong values')
      else:
        outcomes[f'client {client}'] = 'ran (holds no device of stage 1)'
    elif process.returncode < 0:
      outcomes[f'client {client}'] = f'crashed ({signal.Signals(-process.returncode).name})'
    else:
      outcomes[f'client {client}'] = f'exit {process.returncode}, no result'
  return outcomes


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--out', default=os.path.join(RESULTS, 'cross_client_submesh.json'))
  parser.add_argument('--timeout', type=float, default=90)
  parser.add_argument('--placements', default='one client,across clients,within clients')
  args = parser.parse_args()
  rows = []
  for placement in args.placements.split(','):
    for spec in ('unsharded', 'x'):
      for move in ('copy_to_mesh', 'relayout'):
        for mode in ('eager', 'function'):
          row = {'placement': placement, 'source layout': spec, 'move': move, 'mode': mode,
                 **run_clients(placement, spec, move, mode, args.timeout)}
          print(json.dumps(row), flush=True)
          rows.append(row)
  write_json(rows, args.out)


if __name__ == '__main__':
  main()
