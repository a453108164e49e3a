"""The runs under a logdir as the Mesh tab sees them: found, read, compared.

    names = find_runs('/tmp/runs')            # ['lr_sweep/a', 'quickstart', ...]
    mesh = read_mesh('/tmp/runs', 'quickstart')   # mesh.json, checked; MeshDataError if not
    diff = compare(read_mesh(root, 'a'), read_mesh(root, 'b'))

A run is a directory holding a meshgin run record (`mesh.json`, or from
older runs `layouts.txt` or `run_status.json` alone), named as TensorBoard
names runs: its path relative to the logdir, '.' for the logdir itself.
Plain Python: TensorBoard's process imports it without TensorFlow.
"""

from __future__ import annotations

import json
import os
from typing import Any, Sequence

from plugins.mesh_tab import MESH_JSON, MESH_JSON_FORMAT

RUN_MARKERS = (MESH_JSON, 'layouts.txt', 'run_status.json')
SKIPPED_DIRS = ('checkpoints', 'plugins')  # a run's checkpoints and profiles
REQUIRED_KEYS = ('mesh', 'devices', 'rules', 'variables', 'fullest_device')


class MeshDataError(Exception):
  """A run's mesh.json is missing or unreadable; the message says which and why."""


def find_runs(logdir: str) -> list[str]:
  """Every directory under `logdir` holding a run record, sorted by name."""
  runs = []
  for directory, subdirs, files in os.walk(logdir):
    subdirs[:] = [d for d in subdirs if d not in SKIPPED_DIRS and not d.startswith('.')]
    if any(marker in files for marker in RUN_MARKERS):
      runs.append(os.path.relpath(directory, logdir).replace(os.sep, '/'))
  return sorted(runs)


def run_dir(logdir: str, run: str, *, runs: Sequence[str] | None = None) -> str:
  """The directory of `run`; MeshDataError unless it is one of `runs` (by
  default `find_runs(logdir)`, a walk of the logdir)."""
  if run not in (find_runs(logdir) if runs is None else runs):
    raise MeshDataError(f"no run '{run}' under {logdir}")
  return os.path.join(logdir, run)


def _why_missing(directory: str, run: str) -> str:
  message = (f"no {MESH_JSON} in run '{run}' (written by meshgin runs since the Mesh tab, "
             f'{MESH_JSON} format {MESH_JSON_FORMAT}, when training starts')
  try:
    with open(os.path.join(directory, 'run_status.json')) as f:
      status = json.load(f)
  except (OSError, ValueError):
    status = {}
  if status.get('status') in ('config_error', 'data_error', 'crashed') and not os.path.exists(
      os.path.join(directory, 'layouts.txt')):
    return (f"{message}); this run ended before training ({status['status']}: "
            f"{status.get('error') or 'no error recorded'})")
  return (f'{message}; this run has only layouts.txt: run or resume it with this meshgin '
          'to write one)')


def read_mesh(logdir: str, run: str, *, runs: Sequence[str] | None = None) -> dict[str, Any]:
  """The run's mesh.json, checked to be one this tab can draw (`runs`: the
  logdir's runs when the caller has walked it already)."""
  directory = run_dir(logdir, run, runs=runs)
  path = os.path.join(directory, MESH_JSON)
  try:
    with open(path) as f:
      text = f.read()
  except FileNotFoundError:
    raise MeshDataError(_why_missing(directory, run)) from None
  except OSError as e:
    raise MeshDataError(f"{MESH_JSON} in run '{run}' cannot be read: {e.strerror}") from None
  try:
    document = json.loads(text)
  except ValueError as e:
    raise MeshDataError(f"{MESH_JSON} in run '{run}' is not valid JSON ({e}); meshgin writes "
                        'it atomically, so it was changed after the run wrote it') from None
  if not isinstance(document, dict) or document.get('format') != MESH_JSON_FORMAT:
    found = document.get('format') if isinstance(document, dict) else type(document).__name__
    raise MeshDataError(f"{MESH_JSON} in run '{run}' has format {found!r}; this Mesh tab "
                        f'reads format {MESH_JSON_FORMAT}')
  missing = [key for key in REQUIRED_KEYS if key not in document]
  if missing:
    raise MeshDataError(f"{MESH_JSON} in run '{run}' lacks {', '.join(missing)}")
  return document


def _spec_text(spec) -> str:
  return '(' + ', '.join(spec) + ')'


def _layout(variable: dict[str, Any] | None) -> dict[str, Any] | None:
  if variable is None:
    return None
  return {'spec': variable['spec'], 'mesh': variable['mesh'],
          'bytes_per_device': variable['bytes_per_device'],
          'num_slices': len(variable['slices'])}


def _changes(a: dict[str, Any] | None, b: dict[str, Any] | None) -> list[str]:
  if a is None or b is None:
    return ['only in ' + ('B' if a is None else 'A')]
  changes = []
  if a['spec'] != b['spec']:
    changes.append(f"sharding {_spec_text(a['spec'])} -> {_spec_text(b['spec'])}")
  if a['mesh'] != b['mesh']:
    changes.append(f"mesh {a['mesh'] or 'whole'} -> {b['mesh'] or 'whole'}")
  if a['bytes_per_device'] != b['bytes_per_device']:
    changes.append(f"bytes/device {a['bytes_per_device']:,} -> {b['bytes_per_device']:,}")
  if not changes and a['slices'] != b['slices']:
    changes.append('slices on other devices')
  return changes


def _axes_text(mesh: dict[str, Any]) -> str:
  return ' x '.join(f'{name}={size}' for name, size in mesh['axes'])


def compare(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
  """Two runs' layouts side by side: every variable (changed: its sharding,
  sub-mesh, bytes per device or slices differ) and every device's bytes."""
  by_path_a = {v['path']: v for v in a['variables']}
  by_path_b = {v['path']: v for v in b['variables']}
  variables = []
  for path in dict.fromkeys([*by_path_a, *by_path_b]):
    x, y = by_path_a.get(path), by_path_b.get(path)
    changes = _changes(x, y)
    variables.append({'path': path, 'a': _layout(x), 'b': _layout(y),
                      'changed': bool(changes), 'changes': changes})
  devices_a = {d['id']: d for d in a['devices']}
  devices_b = {d['id']: d for d in b['devices']}
  devices = [{'id': i,
              'a': devices_a[i]['bytes'] if i in devices_a else None,
              'b': devices_b[i]['bytes'] if i in devices_b else None}
             for i in sorted({*devices_a, *devices_b})]
  return {'mesh': {'a': _axes_text(a['mesh']), 'b': _axes_text(b['mesh'])},
          'fullest_device': {'a': a['fullest_device'], 'b': b['fullest_device']},
          'num_changed': sum(v['changed'] for v in variables),
          'variables': variables, 'devices': devices}
