"""Clients that agree: the clients of one multi-client run compare what they
are about to run before any of them builds a model, takes a step or saves.

    check_clients_agree(plan, cluster)   # after joining; ConfigError on every client

Each client posts its fingerprint (`fingerprint(plan)`: named settings) to the
others through TF's coordination service; every client then finds the same
first differing setting, so all of them exit 2 with the same message naming
the setting and the clients that differ. The settings: every binding of the
operative gin config (files and `--gin_bindings` alike, so a differing
learning rate or mesh shows by its gin name), the task as it describes itself,
the TensorFlow version, and a digest of meshgin's own source (clients running
different code are not one run). `--model_dir` is not in it: the checkpointer
checks that every client sees the same directory.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os

from layout_core.errors import ConfigError
from layout_core.layout import cluster as cluster_lib
from plugins.gin_setup import gin_settings
from plugins.plan import RunPlan

_PACKAGES = ('layout_core', 'plugins', 'launch')


@functools.lru_cache(maxsize=1)
def code_digest() -> str:
  """sha256 (16 hex digits) of meshgin's Python sources, by relative path."""
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  digest = hashlib.sha256()
  for package in _PACKAGES:
    for directory, subdirs, files in sorted(os.walk(os.path.join(root, package))):
      subdirs.sort()
      for name in sorted(f for f in files if f.endswith('.py')):
        path = os.path.join(directory, name)
        digest.update(os.path.relpath(path, root).encode() + b'\0')
        with open(path, 'rb') as f:
          digest.update(f.read() + b'\0')
  return digest.hexdigest()[:16]


def fingerprint(plan: RunPlan) -> dict[str, str]:
  """The named settings clients must agree on (see the module doc)."""
  from layout_core.lazy import tf  # pylint: disable=g-import-not-at-top
  return {**gin_settings(plan.operative_config), 'task (as described)': plan.task.describe(),
          'TensorFlow version': tf.__version__, 'meshgin code (sha256 of its sources)':
          code_digest()}


def disagreement(fingerprints: list[dict[str, str]]) -> str | None:
  """None when every client's fingerprint equals client 0's; otherwise what
  differs: the first setting (client 0's order), who differs, and how many."""
  names = list(fingerprints[0])
  for other in fingerprints[1:]:
    names += [n for n in other if n not in names]
  differing = [n for n in names if len({f.get(n) for f in fingerprints}) > 1]
  if not differing:
    return None
  first = differing[0]
  reference = fingerprints[0].get(first)
  others = [c for c, f in enumerate(fingerprints) if f.get(first) != reference]

  def shown(value):
    return 'not set' if value is None else repr(value if len(value) < 80 else value[:77] + '...')
  text = (f'client 0 has {first} = {shown(reference)}; ' + '; '.join(
      f'client {c} has {shown(fingerprints[c].get(first))}' for c in others))
  more = (f' ({len(differing)} settings differ: {", ".join(differing[:6])}'
          f'{", ..." if len(differing) > 6 else ""})' if len(differing) > 1 else '')
  return f'client(s) {others} differ from client 0 on {first}: {text}{more}'


def check_clients_agree(plan: RunPlan, cluster: cluster_lib.ClusterSpec, *,
                        timeout: float | None = None) -> None:
  """ConfigError on every client unless all resolved the same run."""
  if not cluster.is_multi_client:
    return
  timeout = timeout or cluster.init_timeout
  posted = cluster_lib.exchange(cluster, key='fingerprint', value=json.dumps(fingerprint(plan)),
                                timeout=timeout)
  problem = disagreement([json.loads(text) for text in posted])
  if problem:
    cluster_lib.settle_before_leaving(cluster, key='fingerprint', timeout=timeout)
    raise ConfigError(
        f'the clients of this run were started with different settings, so they would '
        f'not train one model: {problem}. Nothing was trained or saved',
        where='each client\'s --gin_file / --gin_bindings',
        fix='start every client with the same config files, bindings and meshgin code')
