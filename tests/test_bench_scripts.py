"""Every benchmark script imports, so a helper moved elsewhere breaks no script unseen.

The scripts run by hand, for hours, so nothing else imports most of them:
bench/peak_breakdown.py (and bench/fsdp_collectives.py through it) imported
a helper bench/memory.py no longer had, and failed only when next run. Each
script here is imported (its module-level code run, `main` not called) in
one child process, away from the suite's own TensorFlow set-up.
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_IMPORT_EACH = r'''
import importlib.util, json, sys, traceback
failed = {}
paths = sys.argv[1:]
for number, path in enumerate(paths):
  sys.argv = [path]  # one (bench/pipeline.py) reads its flags on import, before TensorFlow's
  name = f'bench_script_{number}'
  spec = importlib.util.spec_from_file_location(name, path)
  module = sys.modules[name] = importlib.util.module_from_spec(spec)  # as import does
  try:
    spec.loader.exec_module(module)
  except BaseException:  # SystemExit too: a script that exits on import is broken
    failed[path] = traceback.format_exc(limit=1).strip().splitlines()[-1]
print('RESULT ' + json.dumps(failed))
'''


def import_failures(paths: list[str]) -> dict[str, str]:
  """path -> the error its import raised, for each script that does not
  import. A script that sets TensorFlow's threads as it is imported (bench/pipeline.py)
  cannot after another has started TensorFlow: it is imported again alone."""
  failed = _imported_in_one_child(paths)
  for path in [p for p, error in failed.items() if 'after initialization' in error]:
    failed.pop(path)
    failed.update(_imported_in_one_child([path]))
  return failed


def _imported_in_one_child(paths: list[str]) -> dict[str, str]:
  done = subprocess.run([sys.executable, '-c', _IMPORT_EACH, *paths], cwd=REPO_ROOT,
                        capture_output=True, text=True, check=False,
                        env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL='3'))
  assert 'RESULT ' in done.stdout, done.stderr[-2000:]
  return json.loads(done.stdout.split('RESULT ', 1)[1])


def test_every_bench_script_imports(tmp_path):
  scripts = sorted(glob.glob(os.path.join(REPO_ROOT, 'bench', '*.py'))
                   + glob.glob(os.path.join(REPO_ROOT, 'bench', 'limits', '*.py')))
  broken = tmp_path / 'broken.py'  # the positive control
  broken.write_text('from bench.memory import no_such_helper\n')
  failures = import_failures(scripts + [str(broken)])
  assert list(failures) == [str(broken)], failures
  assert 'no_such_helper' in failures[str(broken)]
