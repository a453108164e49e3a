"""tests/run.py, the README's test command: every test file runs in exactly
one shard, and the shards' measured times are about equal; and the zygote
(tests/zygote.py) the launchers the tests start are forked from, which forks
only while that is safe."""

import glob
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests import conftest, run
from tests.zygote import Zygote, ZygoteUnavailable, differs_at_import


def best_longer_shard(seconds: list[int]) -> int:
  """The longer shard's total in the best cut of `seconds` into two: the
  total less the largest sum of some of them that is at most half of it
  (every sum some of them make, as a set: whole seconds keep it small)."""
  sums = {0}
  for value in seconds:
    sums |= {total + value for total in sums}
  return sum(seconds) - max(total for total in sums if 2 * total <= sum(seconds))


def test_every_file_runs_once_in_shards_of_about_equal_time():
  """The suite lasts as long as its longer shard: within 1% of the best cut
  of the measured times. (The greedy cut's gap between the shards is at most
  one file's figure whatever it cuts, so that bounds nothing; dealing the
  files out in turn is 6% (longest first) to 15% (by name) over the best,
  one shard of everything twice it.)"""
  files = sorted(os.path.relpath(f, run.REPO)
                 for f in glob.glob(os.path.join(run.TESTS, 'test_*.py')))
  cut = run.shards(files, run.SHARDS)
  assert len(cut) == run.SHARDS == 2  # best_longer_shard cuts in two
  assert sorted(f for shard in cut for f in shard) == files
  seconds = lambda f: run.SECONDS.get(os.path.basename(f), run.UNLISTED)  # noqa: E731
  totals = sorted(sum(seconds(f) for f in shard) for shard in cut)
  best = best_longer_shard([seconds(f) for f in files])
  assert totals[-1] <= 1.01 * best, (totals, best)
  assert best_longer_shard([3, 3, 2, 2, 2]) == 6 and best_longer_shard([5, 1, 1]) == 5


def test_a_shard_killed_by_a_signal_fails_the_suite():
  """A shard's exit status as the suite counts it, from real processes: a
  pytest killed mid-run (Popen's returncode -9, below the other shard's 0)
  fails the suite, which would otherwise pass without the shard's tests."""
  def ended(code: str) -> int:
    return subprocess.run([sys.executable, '-c', code], check=False).returncode
  killed = ended('import os, signal; os.kill(os.getpid(), signal.SIGKILL)')
  assert killed == -signal.SIGKILL
  assert run.exit_status(killed) == 128 + signal.SIGKILL
  assert run.exit_status(ended('raise SystemExit(1)')) == 1
  assert run.exit_status(ended('raise SystemExit(5)')) == 0  # pytest: nothing collected
  assert run.exit_status(ended('pass')) == 0


def test_the_shards_and_their_runs_allocate_with_jemalloc():
  """What tests.run gives the shards loads jemalloc into a real process and
  into the processes it starts (the launched runs), keeps a preload already
  set, and is not added twice. README command 2 installs libjemalloc2: this
  fails where it is missing, naming it."""
  env = run.with_jemalloc({'PATH': os.environ['PATH']})
  assert 'jemalloc' in env.get('LD_PRELOAD', ''), (
      'no libjemalloc: apt-get install libjemalloc2 (README command 2 does)')
  show_maps = "print(open('/proc/self/maps').read())"
  parent_and_child = (f'import subprocess, sys; {show_maps}; print("CHILD", flush=True); '
                      f'subprocess.run([sys.executable, "-c", {show_maps!r}])')
  shown = subprocess.run([sys.executable, '-c', parent_and_child], env=env, capture_output=True,
                         text=True, check=True).stdout
  own, child = shown.split('CHILD')
  assert 'libjemalloc' in own and 'libjemalloc' in child
  plain = subprocess.run([sys.executable, '-c', show_maps],
                         env={'PATH': os.environ['PATH']}, capture_output=True, text=True,
                         check=True).stdout
  assert 'libjemalloc' not in plain  # the control: a process without the preload
  assert run.with_jemalloc(env) == env
  kept = run.with_jemalloc({'LD_PRELOAD': 'libfoo.so'})['LD_PRELOAD'].split()
  assert kept[1:] == ['libfoo.so'] and 'jemalloc' in kept[0]


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
  assert seen['tensorflow_preloaded'] and seen['parent'] == zygote.process.pid, seen
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


@needs_zygote
def test_a_forked_runs_own_runs_are_forked_too_and_anything_else_runs_as_python():
  """tests/zygote_shim.py, the `sys.executable` of a run forked for
  launch.local_cluster, launch.inspect or launch.sweep: its `-m` runs are
  forked from the zygote too (the zygote their parent, TensorFlow preloaded)
  with their environment, streams and exit status; a signal to the shim
  reaches the run and a SIGKILL to it ends the run; a run killed by a signal
  (SIGKILL too) takes its shim with it; anything else, and a run under Slurm,
  runs in the real interpreter."""
  zygote = conftest._zygote()
  shim = zygote.python
  env = conftest.launcher_environment({'MESHGIN_PROBE': 'shim'})
  done = subprocess.run([shim, '-m', PROBE, '3'], cwd=run.REPO, env=env,
                        capture_output=True, text=True, timeout=60)
  seen = json.loads(done.stdout)
  assert done.returncode == 3 and done.stderr.strip() == 'to stderr', done
  assert seen['tensorflow_preloaded'] and seen['parent'] == zygote.process.pid, seen
  assert seen['probe_value'] == 'shim' and seen['argv'] == ['3']
  other = subprocess.run([shim, '-c', 'import sys; print(sys.executable)'], env=env,
                         capture_output=True, text=True, timeout=60)
  assert other.returncode == 0 and other.stdout.strip() == sys.executable, other
  # A run Slurm started stays in its job: the real interpreter, as its own process.
  slurms = subprocess.run([shim, '-m', PROBE, '3'], cwd=run.REPO,
                          env={**env, 'SLURM_JOB_ID': '7'}, capture_output=True, text=True,
                          timeout=60)
  seen = json.loads(slurms.stdout)
  assert slurms.returncode == 3 and not seen['tensorflow_preloaded'], slurms
  assert seen['parent'] == os.getpid(), seen
  for signum in (signal.SIGTERM, signal.SIGKILL):
    waiting = subprocess.Popen([shim, '-u', '-m', PROBE, '0', '60'], cwd=run.REPO, env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    forked = json.loads(waiting.stdout.readline())['pid']
    waiting.send_signal(signum)
    assert waiting.wait(timeout=30) == -signum
    deadline = time.monotonic() + 10
    while os.path.exists(f'/proc/{forked}'):  # the zygote reaps it once it is killed
      assert time.monotonic() < deadline, f'forked run {forked} outlived its shim ({signum})'
      time.sleep(0.05)
    waiting.stdout.close()
  for signum in (signal.SIGTERM, signal.SIGKILL):  # to the run: the shim dies of it too
    waiting = subprocess.Popen([shim, '-u', '-m', PROBE, '0', '60'], cwd=run.REPO, env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    os.kill(json.loads(waiting.stdout.readline())['pid'], signum)
    assert waiting.wait(timeout=30) == -signum
    waiting.stdout.close()


def test_a_zygote_unsafe_to_fork_refuses_and_the_run_gets_a_fresh_interpreter(
    tmp_path, monkeypatch):
  """A zygote whose set-up started a thread and found TensorFlow's devices
  (each unsafe to fork, zygote_probe's functions) forks nothing: the refusal
  names both hazards, and run_module starts the run the other way. (The
  session's zygote forking at all, test_runs_are_forked_..., shows the
  check passes a zygote that is safe.)"""
  zygote = Zygote(str(tmp_path), env=conftest.launcher_environment(),
                  setup=[f'{PROBE}:start_thread', f'{PROBE}:find_tensorflow_devices'])
  try:
    with pytest.raises(ZygoteUnavailable, match='refused to fork') as refused:
      zygote.start([PROBE, '0'], env=zygote.env)
    assert 'physical devices are initialised' in str(refused.value), refused.value
    assert 'Python threads: probe-sleeper' in str(refused.value), refused.value
    monkeypatch.setattr(conftest, '_zygote', lambda: zygote)
    done = conftest.run_module(PROBE, '4')
    assert done.returncode == 4 and not json.loads(done.stdout)['tensorflow_preloaded']
    assert zygote.process.poll() is None  # refusing, it serves on
  finally:
    zygote.close()
