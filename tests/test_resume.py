"""Resume, preemption and crash safety with real processes and real signals."""

import os
import random
import re
import signal
import subprocess
import time

import numpy as np
import pytest
import tensorflow as tf

from tests.conftest import TWO_DEVICES, Launched, read_events, run_module, run_modules

BASE = ['--gin_file=configs/experiments/quickstart.gin', TWO_DEVICES,
        '--gin_bindings=train.eval_batches = 1', '--gin_bindings=train.log_every = 1',
        "--gin_bindings=optimizer.decay = 'constant'"]


def final_values(model_dir):
  prefix = tf.train.latest_checkpoint(os.path.join(model_dir, 'checkpoints'))
  reader = tf.train.load_checkpoint(prefix)
  return {k: reader.get_tensor(k) for k in reader.get_variable_to_shape_map()
          if k.endswith('VARIABLE_VALUE')}


def test_n_plus_n_steps_equals_2n_steps_bit_exactly(tmp_path):
  straight, resumed = str(tmp_path / 'straight'), str(tmp_path / 'resumed')
  steps = ['--gin_bindings=train.eval_every = 0', '--gin_bindings=checkpoint.every_steps = 0']
  a, b1 = run_modules([  # independent: started together
      ('launch.train', *BASE, *steps, '--gin_bindings=train.num_steps = 8',
       f'--model_dir={straight}'),
      ('launch.train', *BASE, *steps, '--gin_bindings=train.num_steps = 4',
       f'--model_dir={resumed}')])
  b2 = run_module('launch.train', *BASE, *steps, '--gin_bindings=train.num_steps = 8',
                  f'--model_dir={resumed}')
  for result in (a, b1, b2):
    assert result.returncode == 0, result.stderr[-2000:]
  assert re.search(r'Resumed from .*ckpt-4/ckpt at step 4', b2.stderr)
  # The longer horizon is said, with the schedule's rate at the resumed step
  # under both horizons (independently, from the schedule's own formula).
  from layout_core.optim import OptimizerConfig, learning_rate
  config = OptimizerConfig(learning_rate=3e-3, warmup_steps=30, decay='constant')  # BASE's
  assert re.search(r'Resumed at step 4 with settings that differ from .*ckpt-4/config.gin:\n'
                   r'  train.num_steps: 4 -> 8\n', b2.stderr), b2.stderr[-3000:]
  assert (f'the learning-rate schedule now spans 8 steps (was 4): at step 4 the rate is '
          f'{float(learning_rate(config, 4, 8)):.3e} ({float(learning_rate(config, 4, 4)):.3e} '
          'under the old schedule)') in b2.stderr
  changes = read_events(resumed)['text']['resume/changed_settings']
  assert changes and 'train.num_steps: 4 -> 8' in changes[-1]
  expected, actual = final_values(straight), final_values(resumed)
  assert expected.keys() == actual.keys()
  for key in expected:
    np.testing.assert_array_equal(actual[key], expected[key], err_msg=key)
  assert expected['counters/step/.ATTRIBUTES/VARIABLE_VALUE'] == 8

  events = read_events(resumed)
  assert [s for s, _ in events['scalars']['usage/checkpoint_restore_seconds']] == [4]
  assert [s for s, _ in events['scalars']['usage/checkpoint_save_seconds']] == [4, 8]
  assert all(v > 0 for _, v in events['scalars']['usage/checkpoint_size_mib'])
  saves, restores = events['text']['checkpoint/saves'], events['text']['checkpoint/restores']
  assert all('(final' in line for line in saves) and len(saves) == 2
  assert len(restores) == 1 and '(resume' in restores[0] and 'ckpt-4' in restores[0]


_STARTED: list[subprocess.Popen] = []


@pytest.fixture(autouse=True)
def no_orphans():
  """Kills any training process a failed test left running."""
  yield
  while _STARTED:
    process = _STARTED.pop()
    if process.poll() is None:
      process.kill()
      process.wait(30)


class Training(Launched):
  """A launch.train process of the BASE config, tracked for `no_orphans`."""

  def __init__(self, model_dir, *extra):
    super().__init__('launch.train', *BASE, f'--model_dir={model_dir}', *extra,
                     label='launch.train')
    _STARTED.append(self.process)

  def saved_steps(self):
    return [int(m.group(1)) for m in re.finditer(r'Saved checkpoint \S+ at step (\d+)',
                                                 ''.join(self.lines))]


def test_sigterm_saves_and_exits_0_then_resumes(tmp_path):
  model_dir = str(tmp_path / 'run')
  run = Training(model_dir, '--gin_bindings=train.num_steps = 100000',
                 '--gin_bindings=checkpoint.every_steps = 0')
  run.wait_for(r'step 3/100000')
  run.process.send_signal(signal.SIGTERM)
  output = run.finish()
  assert run.process.returncode == 0, output[-2000:]
  match = re.search(r'Preempted by SIGTERM at step (\d+): saved (\S+)\. Run the same', output)
  assert match, output[-2000:]
  step = int(match.group(1))
  assert os.path.isfile(match.group(2) + '.index')
  again = run_module('launch.train', *BASE, f'--gin_bindings=train.num_steps = {step + 2}',
                     f'--model_dir={model_dir}')
  assert again.returncode == 0 and f'at step {step}' in again.stderr
  # The same model_dir with another model: exit 2, checkpoint untouched.
  before = sorted(os.listdir(os.path.join(model_dir, 'checkpoints')))
  other = run_module('launch.train', *BASE, '--gin_bindings=transformer_lm.num_layers = 3',
                     f'--model_dir={model_dir}')
  assert other.returncode == 2 and 'does not match this model' in other.stderr
  assert 'block_002' in other.stderr and 'Traceback' not in other.stderr
  assert sorted(os.listdir(os.path.join(model_dir, 'checkpoints'))) == before


def test_sigkill_at_random_moments_never_loses_a_completed_save(tmp_path):
  model_dir = str(tmp_path / 'run')
  rng = random.Random(1234)
  last_saved, last_resumed = 0, 0
  for trial in range(3):  # 3 kills, 2 checked resumes: each trial is a fresh start-up
    run = Training(model_dir, '--gin_bindings=train.num_steps = 100000',
                   '--gin_bindings=checkpoint.every_steps = 1',
                   '--gin_bindings=train.eval_every = 0')
    started = run.wait_for(r'Training steps (\d+)\.\.')
    resumed = int(started.group(1))
    if trial:
      # Every completed save survives; a save killed before its commit is ignored.
      assert resumed >= last_saved, (trial, resumed, last_saved)
      assert resumed >= last_resumed
    run.wait_for(rf'step {resumed + 1}/100000')  # compiled and training
    time.sleep(rng.uniform(0.0, 1.0))  # saves run every step: kills land in them too
    run.process.kill()
    output = run.finish()
    assert 'is unusable' not in output, output[-3000:]
    last_saved = max([last_saved] + run.saved_steps())
    last_resumed = resumed
  assert last_saved > 0
  leftovers = [n for n in os.listdir(os.path.join(model_dir, 'checkpoints'))
               if n.startswith('tmp-')]
  assert len(leftovers) <= 1  # only the last killed save's, cleaned at next start


def wait_until_catching(pid, signum, timeout=30):
  """Waits until process `pid` has a handler for `signum` (/proc's SigCgt mask)."""
  deadline = time.time() + timeout
  while time.time() < deadline:
    with open(f'/proc/{pid}/status') as f:
      caught = next(int(line.split()[1], 16) for line in f if line.startswith('SigCgt:'))
    if caught & (1 << (signum - 1)):
      return
    time.sleep(0.005)
  raise AssertionError(f'process {pid} never caught signal {signum}')


def test_a_start_up_stop_that_other_code_swallowed_still_stops_at_the_hand_over():
  """A start-up signal's `Interrupted` can be turned into another error by
  code it crosses (numpy's C import makes it an ImportError) or swallowed by
  an `except ImportError`; the run still stops where writing would begin."""
  from layout_core.train.preemption import Interrupted, PreemptionWatcher
  with PreemptionWatcher(immediate=True) as watcher:
    try:
      os.kill(os.getpid(), signal.SIGTERM)
      time.sleep(1)  # the handler raises in the main thread before this ends
    except Interrupted:
      pass  # what code between the signal and the hand-over might do
    assert watcher.stopped_during_start_up
    with pytest.raises(Interrupted):
      watcher.defer()
  with PreemptionWatcher(immediate=True) as quiet:
    quiet.defer()  # no signal: writing starts
    assert not quiet.stopped_during_start_up


def test_a_start_up_signal_waits_for_an_uninterrupted_step_to_end():
  """Taking the model_dir's lock and registering its release happen whole:
  a signal in between raises only when the step ends (else the lock's record
  stayed in the file: a run stopped at start-up changed the directory)."""
  from layout_core.train.preemption import Interrupted, PreemptionWatcher
  done = []
  with PreemptionWatcher(immediate=True) as watcher:
    with pytest.raises(Interrupted):
      with watcher.uninterrupted():
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.2)  # the handler has run by now, and raised nothing
        done.append('whole')
    assert done == ['whole']
    with pytest.raises(Interrupted):
      os.kill(os.getpid(), signal.SIGTERM)
      time.sleep(1)  # outside the step: at once, as before


def test_sigterm_during_start_up_exits_0_and_changes_nothing(tmp_path):
  """A stop signal at any moment before training starts: exit 0, a message,
  and the existing run byte-identical (nothing had been written yet)."""
  from tests.test_bad_input import tree_digest  # pylint: disable=import-outside-toplevel
  model_dir = str(tmp_path / 'run')
  first = run_module('launch.train', *BASE, '--gin_bindings=train.num_steps = 2',
                     '--gin_bindings=train.eval_every = 0', f'--model_dir={model_dir}')
  assert first.returncode == 0, first.stderr[-2000:]
  before = tree_digest(model_dir)
  # Not tested: the window while TensorFlow initialises its devices, where its
  # own handler can take the signal (README, Limits).
  moments = [('as soon as it catches SIGTERM', None), ('while gin is parsed', 0.05)]
  for name, moment in moments:
    run = Training(model_dir, '--gin_bindings=train.num_steps = 4')
    wait_until_catching(run.process.pid, signal.SIGTERM)
    if moment:
      time.sleep(moment)
    run.process.send_signal(signal.SIGTERM)
    output = run.finish(timeout=60)
    assert run.process.returncode == 0, (name, output[-2000:])
    assert 'Stopped by SIGTERM during start-up' in output, (name, output[-2000:])
    assert 'Traceback' not in output, name
    assert tree_digest(model_dir) == before, name
