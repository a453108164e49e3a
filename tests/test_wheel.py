"""meshgin as a user installs it: a wheel, in a fresh venv outside the checkout.

The wheel is built from a copy of the repository (so a file that
pyproject.toml forgets to ship is missing from it, as it would be for a
user), installed with pip into a new virtual environment, and run from an
empty directory outside the repository: the quickstart trains with
`--gin_file=configs/experiments/quickstart.gin` found inside the installed
package, and ends where the same command from the checkout ends.

The new venv sees the test environment's third-party packages (TensorFlow
and the rest) through a .pth line, so nothing is downloaded; pip installs
without --no-deps and offline, so the wheel's declared dependencies must be
met by them. The checkout's own editable install is not visible: a .pth
line adds a directory to sys.path without running the .pth files in it.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile

import pytest

from tests.conftest import TWO_DEVICES

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NUM_STEPS = 8
STEPS = (f"--gin_bindings=train.num_steps = {NUM_STEPS}", TWO_DEVICES)
# Not sources: at the top of the checkout, and anywhere.
NOT_SOURCES_AT_TOP = {'.git', '.venv', 'runs', 'site', 'build', 'dist'}
NOT_SOURCES = shutil.ignore_patterns('*.egg-info', '__pycache__', '.pytest_cache')


def not_sources(directory: str, names: list[str]) -> set[str]:
  at_top = NOT_SOURCES_AT_TOP if os.path.samefile(directory, REPO_ROOT) else set()
  return (set(names) & at_top) | NOT_SOURCES(directory, names)


def run(args, *, cwd, timeout=300):
  env = {k: v for k, v in os.environ.items() if k not in ('PYTHONPATH', 'PYTHONSTARTUP')}
  proc = subprocess.run(args, cwd=cwd, env=env, stdout=subprocess.PIPE,
                        stderr=subprocess.STDOUT, text=True, timeout=timeout)
  assert proc.returncode == 0, f'{" ".join(map(str, args))} exited {proc.returncode}:\n' + (
      proc.stdout[-4000:])
  return proc.stdout


@pytest.fixture(scope='module')
def installed(tmp_path_factory):
  """(the venv's python, the wheel's path): built, installed, outside the repository."""
  root = tmp_path_factory.mktemp('wheel')
  source = root / 'source'
  shutil.copytree(REPO_ROOT, source, ignore=not_sources)
  run([sys.executable, '-m', 'pip', 'wheel', '-q', '--no-deps', '--no-build-isolation',
       '-w', str(root / 'dist'), str(source)], cwd=root)
  (wheel,) = glob.glob(str(root / 'dist' / 'meshgin-*.whl'))
  venv = root / 'venv'
  run([sys.executable, '-m', 'venv', str(venv)], cwd=root)
  python = str(venv / 'bin' / 'python')
  purelib = run([python, '-c', 'import sysconfig; print(sysconfig.get_paths()["purelib"])'],
                cwd=root).strip()
  with open(os.path.join(purelib, 'test_environment.pth'), 'w') as f:
    f.write(sysconfig.get_paths()['purelib'] + '\n')  # TensorFlow and the rest, not meshgin
  run([python, '-m', 'pip', 'install', '-q', '--no-index', wheel], cwd=root)
  return python, wheel


def test_the_wheel_ships_every_config_and_the_mesh_tab(installed):
  _, wheel = installed
  with zipfile.ZipFile(wheel) as archive:
    shipped = set(archive.namelist())
  in_checkout = {os.path.relpath(path, REPO_ROOT) for pattern in ('*.gin', '*.sweep')
                 for path in glob.glob(os.path.join(REPO_ROOT, 'configs', '**', pattern),
                                       recursive=True)}
  assert in_checkout and not in_checkout - shipped, sorted(in_checkout - shipped)
  assert 'plugins/mesh_tab/static/index.js' in shipped
  assert not any(name.startswith(('tests/', 'bench/')) for name in shipped)


def test_the_installed_package_is_the_one_imported(installed, tmp_path):
  python, _ = installed
  where = run([python, '-c', 'import layout_core, configs; '
               'print(layout_core.__file__); print(configs.__file__)'], cwd=tmp_path)
  paths = where.split()  # a path inside the checkout, not one that merely starts alike
  assert not any(os.path.commonpath([p, REPO_ROOT]) == REPO_ROOT for p in paths), where
  assert len(paths) == 2 and all('/venv/lib/' in p for p in paths), where


def test_the_quickstart_trains_from_outside_the_checkout_as_from_inside(installed, tmp_path):
  python, _ = installed
  elsewhere = tmp_path / 'elsewhere'
  elsewhere.mkdir()
  command = ['-m', 'launch.train', '--gin_file=configs/experiments/quickstart.gin', *STEPS]
  run([python, *command, f'--model_dir={elsewhere}/run'], cwd=elsewhere)
  run([sys.executable, *command, f'--model_dir={tmp_path}/reference'], cwd=REPO_ROOT)

  outcomes = []
  for run_dir in (elsewhere / 'run', tmp_path / 'reference'):
    status = json.loads((run_dir / 'run_status.json').read_text())
    assert status['status'] == 'completed' and status['step'] == NUM_STEPS, status
    outcomes.append((status['metrics']['eval_loss'], (run_dir / 'config.gin').read_text()))
  assert outcomes[0] == outcomes[1]  # the same config, trained to the same loss
