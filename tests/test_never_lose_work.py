"""Faults a busy cluster user meets, each ending with every checkpoint on disk
complete, readable and finite: two writers on one model_dir (trainers and
sweeps, real processes), a diverged model at a save, clients started with
different settings, a model_dir that changes underneath a run, and broken
paths. (A removal in the middle of a save: tests/test_checkpoint.py and
tests/test_checkpoint_safety.py.)"""

import json
import os
import re
import shutil
import signal
import threading
import time

import numpy as np
import pytest
import tensorflow as tf

from layout_core.checkpoint.files import checkpoint_dirs, validate
from layout_core.checkpoint.lock import LOCK_NAME, DirectoryLock, LockedError
from plugins.agreement import disagreement
from plugins.gin_setup import gin_settings
from tests.conftest import Launched, run_module

QUICK = ['--gin_file=configs/experiments/quickstart.gin',
         "--gin_bindings=mesh.shape = {'data': 2}", '--gin_bindings=train.eval_every = 0',
         '--gin_bindings=train.eval_batches = 1', '--gin_bindings=train.log_every = 1']


def steps(n):
  return f'--gin_bindings=train.num_steps = {n}'


def assert_checkpoints_sound(model_dir):
  """Every ckpt-N is complete and readable; the newest holds only finite values."""
  found = checkpoint_dirs(os.path.join(model_dir, 'checkpoints'))
  for _, path in found:
    assert validate(path) is None, validate(path)
    tf.train.load_checkpoint(os.path.join(path, 'ckpt'))
  if found:
    reader = tf.train.load_checkpoint(os.path.join(found[0][1], 'ckpt'))
    for key, dtype in reader.get_variable_to_dtype_map().items():
      if dtype.is_floating:
        assert np.all(np.isfinite(reader.get_tensor(key))), key
  return [step for step, _ in found]


def remove(path):
  """rm -rf, retried: a save may be writing into it at that moment."""
  for _ in range(50):
    shutil.rmtree(path, ignore_errors=True)
    if not os.path.exists(path):
      return
    time.sleep(0.05)
  raise AssertionError(f'could not remove {path}')


def wait_after(launched, pattern, timeout=120):
  """The first match of `pattern` in what `launched` prints from now on."""
  mark, deadline = len(launched.output), time.monotonic() + timeout
  while time.monotonic() < deadline:
    match = re.search(pattern, launched.output[mark:])
    if match:
      return match
    assert launched.process.poll() is None, launched.output[-3000:]
    time.sleep(0.05)
  raise AssertionError(f'no {pattern!r} within {timeout} s:\n{launched.output[-3000:]}')


# -- 1. one writer per model_dir ---------------------------------------------------------
def test_two_trainers_at_once_one_refused_and_a_killed_ones_lock_taken_over(tmp_path):
  model_dir = str(tmp_path / 'run')
  args = [*QUICK, steps(100000), '--gin_bindings=checkpoint.every_steps = 2',
          '--gin_bindings=checkpoint.keep = 1000', f'--model_dir={model_dir}']
  first, second = (Launched('launch.train', *args, label=f'trainer {k}') for k in (1, 2))
  try:
    deadline = time.monotonic() + 120
    while first.process.poll() is None and second.process.poll() is None:
      assert time.monotonic() < deadline, 'neither trainer was refused'
      time.sleep(0.1)
    refused, running = (first, second) if first.process.poll() is not None else (second, first)
    output = refused.finish(timeout=30)
    assert refused.process.returncode == 2, output[-3000:]
    message = ' '.join(output[output.index('Configuration error:'):].split())
    assert f'{model_dir} is in use by another run: pid {running.process.pid} on ' in message
    assert 'launch.train' in message and 'another --model_dir' in message
    assert 'Traceback' not in output

    # 4. the model_dir changing underneath the survivor: a cleaner removes
    # checkpoints/, then the newest checkpoint; the next saves carry on.
    running.wait_for(r'Saved checkpoint .*ckpt-4/ckpt', timeout=300)
    remove(os.path.join(model_dir, 'checkpoints'))
    step = int(wait_after(running, r'Saved checkpoint .*ckpt-(\d+)/ckpt').group(1))
    remove(os.path.join(model_dir, 'checkpoints', f'ckpt-{step}'))
    wait_after(running, f'ckpt-{step}, listed in .* was removed by something else')
    running.process.send_signal(signal.SIGKILL)
    assert 'Traceback' not in running.finish(timeout=30)
  finally:
    for launched in (first, second):
      if launched.process.poll() is None:
        launched.process.kill()
  newest = assert_checkpoints_sound(model_dir)[0]
  resumed = run_module('launch.train', *QUICK, steps(newest + 2), f'--model_dir={model_dir}')
  assert resumed.returncode == 0, resumed.stderr[-3000:]
  assert f'Took over the lock on {model_dir} left by pid {running.process.pid}' in resumed.stderr
  assert 'is no longer running' in resumed.stderr
  assert f'ckpt-{newest}/ckpt at step {newest}' in resumed.stderr
  assert assert_checkpoints_sound(model_dir)[0] == newest + 2
  assert open(os.path.join(model_dir, LOCK_NAME)).read() == ''  # given back


def test_two_sweeps_at_once_on_one_root_one_refused(tmp_path):
  root = str(tmp_path / 'sweep')
  args = [*QUICK, steps(2), '--gin_bindings=checkpoint.every_steps = 0',
          '--sweep=optimizer.learning_rate=[1e-3]', f'--model_dir={root}']
  sweeps = [Launched('launch.sweep', *args, label=f'sweep {k}') for k in (1, 2)]
  try:
    outputs = [s.finish(timeout=300) for s in sweeps]
  finally:
    for s in sweeps:
      if s.process.poll() is None:
        s.process.kill()
  codes = sorted(s.process.returncode for s in sweeps)
  assert codes == [0, 2], outputs
  refused = outputs[[s.process.returncode for s in sweeps].index(2)]
  assert f'{root} is in use by another run' in ' '.join(refused.split())
  assert '(launch.sweep)' in refused


def test_lock_file_records_the_holder_and_refuses_a_second_holder(tmp_path):
  directory = str(tmp_path / 'fresh')
  lock = DirectoryLock.acquire(directory, purpose='launch.train')
  record = json.loads(open(os.path.join(directory, LOCK_NAME)).read())
  assert record['pid'] == os.getpid() and record['purpose'] == 'launch.train'
  with pytest.raises(LockedError, match=f'pid {os.getpid()}'):
    DirectoryLock.acquire(directory, purpose='launch.train')
  lock.release()
  assert not os.path.exists(directory)  # created for nothing: removed again
  # Another host's record with a fresh heartbeat is believed even if flock is free.
  os.makedirs(directory)
  with open(os.path.join(directory, LOCK_NAME), 'w') as f:
    json.dump({'pid': 1, 'host': 'elsewhere', 'started_at': time.time(), 'command': 'x'}, f)
  with pytest.raises(LockedError, match='on another host: pid 1 on elsewhere'):
    DirectoryLock.acquire(directory, purpose='launch.train')
  stale = time.time() - 600
  os.utime(os.path.join(directory, LOCK_NAME), (stale, stale))
  DirectoryLock.acquire(directory, purpose='launch.train').release()  # stale: taken over


def test_the_heartbeat_touches_the_lock_file_and_release_waits_for_it(tmp_path, monkeypatch):
  """A real heartbeat (every 20 ms) moves the lock file's mtime; a release
  that comes while a beat is under way waits for it to end before closing
  the descriptor the beat uses (a closed one may already be another file's)."""
  directory = str(tmp_path / 'run')
  os.makedirs(directory)
  path = os.path.join(directory, LOCK_NAME)
  threads_before = set(threading.enumerate())
  lock = DirectoryLock.acquire(directory, purpose='launch.train', heartbeat_seconds=0.02)
  [heartbeat] = set(threading.enumerate()) - threads_before
  long_ago = time.time() - 600
  os.utime(path, (long_ago, long_ago))
  deadline = time.monotonic() + 30
  while os.stat(path).st_mtime < long_ago + 300:
    assert time.monotonic() < deadline, 'the heartbeat never touched the lock file'
    time.sleep(0.01)

  real_utime, beating, finish_beat = os.utime, threading.Event(), threading.Event()

  def held_beat(target, *args, **kwargs):
    if threading.current_thread() is heartbeat:
      beating.set()
      finish_beat.wait(30)  # the beat is under way until the test lets it end
    return real_utime(target, *args, **kwargs)

  monkeypatch.setattr(os, 'utime', held_beat)
  assert beating.wait(30)
  releasing = threading.Thread(target=lock.release)
  releasing.start()
  releasing.join(0.3)
  assert releasing.is_alive(), 'release() returned while a heartbeat was under way'
  finish_beat.set()
  releasing.join(30)
  assert not releasing.is_alive() and not heartbeat.is_alive()
  assert open(path).read() == ''  # given back
  DirectoryLock.acquire(directory, purpose='launch.train').release()  # and free


# -- 2. only finite checkpoints are committed -------------------------------------------
def test_a_diverged_state_is_never_saved_and_the_first_bad_step_is_named(tmp_path):
  """learning_rate 1e30 without clipping: step 1 is finite, step 2's loss is not.
  Saves every step, loss checked only every 100 steps: the save of step 2 is refused."""
  model_dir = str(tmp_path / 'run')
  result = run_module('launch.train', *QUICK[:-1], steps(6), '--gin_bindings=train.log_every = 100',
                      '--gin_bindings=optimizer.learning_rate = 1e30',
                      "--gin_bindings=optimizer.decay = 'constant'",
                      '--gin_bindings=optimizer.warmup_steps = 0',
                      '--gin_bindings=optimizer.clip_norm = 0',
                      '--gin_bindings=checkpoint.every_steps = 1', f'--model_dir={model_dir}')
  assert result.returncode == 3, result.stderr[-3000:]
  assert 'Training diverged: train loss is nan at step 2' in result.stderr.replace('inf', 'nan')
  assert assert_checkpoints_sound(model_dir) == [1]
  assert tf.train.latest_checkpoint(os.path.join(model_dir, 'checkpoints')).endswith('ckpt-1/ckpt')
  status = json.load(open(os.path.join(model_dir, 'run_status.json')))
  assert (status['status'], status['exit_code']) == ('diverged', 3)


# -- 3. clients agree before they train ---------------------------------------------------
def test_clients_started_with_different_settings_all_exit_2_and_save_nothing(tmp_path):
  model_dir = str(tmp_path / 'run')
  result = run_module('launch.local_cluster', '--num_clients=2', '--devices_per_client=1',
                      '--client_arg=1:--gin_bindings=optimizer.learning_rate = 0.5', '--',
                      *QUICK, steps(4), f'--model_dir={model_dir}', timeout=300)
  assert result.returncode == 2, result.stdout[-4000:]
  for client in (0, 1):
    lines = ' '.join(line.split(']', 1)[1] for line in result.stdout.splitlines()
                     if line.startswith(f'[client {client}]'))
    assert 'Configuration error: the clients of this run were started with different' in lines
    assert ("client(s) [1] differ from client 0 on optimizer.learning_rate: client 0 has "
            "optimizer.learning_rate = '0.003'; client 1 has '0.5'") in lines, lines[-2000:]
  assert '[cluster] exit status per client: [2, 2]' in result.stdout
  assert not os.path.exists(os.path.join(model_dir, 'checkpoints'))


def test_fingerprints_compare_by_setting():
  config = ('# Parameters for train:\n# ====\ntrain.batch_size = 32\ntrain.rules = [\n'
            "    ('a', 'b'),\n]\n\noptimizer.learning_rate = 0.003\n")
  settings = gin_settings(config)
  assert settings == {'train.batch_size': '32', 'train.rules': "[ ('a', 'b'), ]",
                      'optimizer.learning_rate': '0.003'}
  other = dict(settings, **{'optimizer.learning_rate': '0.5', 'extra.key': '1'})
  assert disagreement([settings, settings]) is None
  problem = disagreement([settings, settings, other])
  assert problem.startswith('client(s) [2] differ from client 0 on optimizer.learning_rate')
  assert '2 settings differ: optimizer.learning_rate, extra.key' in problem


# -- 5. paths ------------------------------------------------------------------------------
def test_a_dangling_symlink_model_dir_exits_2_naming_link_and_target(tmp_path):
  link, target = tmp_path / 'link', tmp_path / 'unmounted' / 'disk'
  os.symlink(target, link)
  result = run_module('launch.train', *QUICK, steps(2), f'--model_dir={link}/run')
  assert result.returncode == 2, result.stderr[-3000:]
  message = ' '.join(result.stderr.split())
  assert f"goes through the symbolic link '{link}', whose target '{target}' does not exist" \
      in message
  assert 'Traceback' not in result.stderr
  assert not target.exists() and not (tmp_path / 'unmounted').exists()
