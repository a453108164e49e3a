"""tests/run.py, the README's test command: every test file runs in exactly
one shard, and the shards' measured times are about equal; and the zygote
(tests/zygote.py) the launchers the tests start are forked from."""

import glob
import json
import os
import signal
import subprocess

import pytest

from tests import conftest, run
from tests.zygote import differs_at_import


def test_every_file_runs_once_in_shards_of_about_equal_time():
  files = sorted(os.path.relpath(f, run.REPO)
                 for f in glob.glob(os.path.join(run.TESTS, 'test_*.py')))
  cut = run.shards(files, run.SHARDS)
  assert len(cut) == run.SHARDS
  assert sorted(f for shard in cut for f in shard) == files
  seconds = lambda shard: sum(run.SECONDS.get(os.path.basename(f), run.UNLISTED)  # noqa: E731
                              for f in shard)
  totals = sorted(seconds(shard) for shard in cut)
  assert totals[-1] - totals[0] <= max(run.SECONDS.values()), totals


def test_the_figures_name_only_files_that_exist():
  assert all(os.path.isfile(os.path.join(run.TESTS, name)) for name in run.SECONDS)


PROBE = 'tests.fixtures.zygote_probe'
needs_zygote = pytest.mark.skipif(os.environ.get('MESHGIN_TEST_FRESH_PROCESSES') == '1',
                                  reason='MESHGIN_TEST_FRESH_PROCESSES=1: no zygote')


@needs_zygote
def test_runs_are_forked_from_the_zygote_as_separate_processes():
  """run_module: a forked process of its own (not the zygote, TensorFlow
  already imported), with the run's environment, both streams and its exit
  status; a run that changes an import-time variable gets a fresh interpreter."""
  zygote = conftest._zygote()
  assert zygote is not None
  done = conftest.run_module(PROBE, '3', env={'MESHGIN_PROBE': 'forked'})
  seen = json.loads(done.stdout)
  assert done.returncode == 3 and done.stderr.strip() == 'to stderr'
  assert seen['tensorflow_preloaded'] and seen['parent'] == zygote.process.pid
  assert seen['pid'] not in (zygote.process.pid, os.getpid())
  assert seen['probe_value'] == 'forked' and seen['argv'] == ['3']
  fresh = conftest.run_module(PROBE, '0', env={'TF_CPP_MIN_LOG_LEVEL': '1'})
  assert fresh.returncode == 0 and not json.loads(fresh.stdout)['tensorflow_preloaded']
  assert differs_at_import({'TF_CPP_MIN_LOG_LEVEL': '1'}, {'TF_CPP_MIN_LOG_LEVEL': '2'})
  assert not differs_at_import({'MESHGIN_PROBE': 'a'}, {})


@needs_zygote
def test_a_forked_run_in_its_own_session_takes_signals_and_timeouts():
  run = conftest.Launched(PROBE, '0', '60', new_session=True)
  with conftest.killed_if_left(run):
    seen = json.loads(run.wait_for(r'\{.*\}\n').group(0))
    assert seen['tensorflow_preloaded'] and seen['group'] == seen['pid'] == run.process.pid
    assert run.process.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
      run.process.wait(timeout=0.2)
    os.killpg(run.process.pid, signal.SIGTERM)
    assert run.process.wait(timeout=30) == -signal.SIGTERM
  with pytest.raises(subprocess.TimeoutExpired):
    conftest.run_module(PROBE, '0', '60', timeout=1)
