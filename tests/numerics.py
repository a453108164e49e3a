"""How close two computations of the same math must be, relative to their scale.

Two computations that sum in another order (another mesh, engine, remat,
micro-batching, a cached decoder, an export) round differently, and how
much depends on the machine's kernels and thread count. The difference
grows with the magnitudes summed, so `assert_close` bounds the largest
difference by a fraction of the reference's scale (its largest magnitude):

    max |actual - expected|  <=  rel * max |expected|

Each `rel` is taken from measurement and written at its call with what was
measured. To measure: run the tests with MESHGIN_NUMERICS_LOG=FILE (each
comparison appends its relative error to FILE, launched runs excepted),
under each setting that changes the kernels or their order:

    MESHGIN_NUMERICS_LOG=default.jsonl python -m pytest tests/...
    TF_ENABLE_ONEDNN_OPTS=0 MESHGIN_NUMERICS_LOG=no_onednn.jsonl python -m pytest tests/...
    TF_NUM_INTRAOP_THREADS=1 MESHGIN_NUMERICS_LOG=one_thread.jsonl python -m pytest tests/...
    python -m tests.numerics default.jsonl no_onednn.jsonl one_thread.jsonl

The last prints, per comparison site (test file, function, and the label
`what` up to its first colon), the largest relative error under each
setting and the bound it is held to. Results that should be bit-exact by
design (the same program on the same mesh: resume, loss traces) are compared
with `==`, not here.

Importing this module does not import TensorFlow.
"""

from __future__ import annotations

import collections
import inspect
import json
import os
import sys

import numpy as np


def relative_error(actual, expected) -> tuple[float, float]:
  """(max |actual - expected| / max |expected|, max |expected|); the first is
  0 where both are all zero."""
  actual = np.asarray(actual, np.float64)
  expected = np.asarray(expected, np.float64)
  assert actual.shape == expected.shape, (actual.shape, expected.shape)
  error = float(np.max(np.abs(actual - expected), initial=0.0))
  scale = float(np.max(np.abs(expected), initial=0.0))
  if error == 0.0:
    return 0.0, scale
  return (error / scale if scale > 0 else float('inf')), scale


def assert_close(actual, expected, *, rel: float, what: str = '') -> None:
  """Fails unless `actual` is within `rel` of `expected`'s scale (see the module doc)."""
  measured, scale = relative_error(actual, expected)
  _record(measured, rel, what)
  assert measured <= rel, (
      f'{what + ": " if what else ""}differs by {measured:.3g} of the reference\'s scale '
      f'(max |expected| = {scale:.3g}); allowed {rel:g}')


def _record(measured: float, rel: float, what: str) -> None:
  path = os.environ.get('MESHGIN_NUMERICS_LOG')
  if not path:
    return
  caller = inspect.stack()[2]  # the test's frame, past assert_close
  site = f'{os.path.basename(caller.filename)}::{caller.function}'
  if what:
    site += f' [{what.split(":")[0]}]'  # the label up to its first colon
  with open(path, 'a') as f:
    f.write(json.dumps({'site': site, 'measured': measured, 'rel': rel}) + '\n')


def summary(paths: list[str]) -> str:
  """A table: per site, the largest relative error in each log, and its bound."""
  worst: dict = collections.defaultdict(dict)
  bounds = {}
  for path in paths:
    with open(path) as f:
      for line in f:
        record = json.loads(line)
        name = os.path.basename(path).rsplit('.', 1)[0]
        cell = worst[record['site']]
        cell[name] = max(cell.get(name, 0.0), record['measured'])
        bounds[record['site']] = record['rel']
  names = [os.path.basename(p).rsplit('.', 1)[0] for p in paths]
  rows = [' | '.join(['site', *names, 'bound', 'margin'])]
  for site in sorted(worst):
    most = max(worst[site].values())
    margin = f'{bounds[site] / most:.0f}x' if most else 'exact'
    rows.append(' | '.join([site, *(f'{worst[site].get(n, float("nan")):.2g}' for n in names),
                            f'{bounds[site]:g}', margin]))
  return '\n'.join(rows)


if __name__ == '__main__':
  print(summary(sys.argv[1:]))
