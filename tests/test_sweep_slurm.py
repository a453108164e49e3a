"""launch.sweep --launcher=slurm against a real one-node Slurm (tests/slurm.py).

One real sweep of three trials, two jobs at a time, is stopped by SIGTERM and
run again; what it did is read back from Slurm itself (squeue), the trials'
own run_status.json and logs, and a real TensorBoard's HParams dashboard. A
stand-in trial (no TensorFlow) checks --slurm_on_stop=leave and the adoption
of the job it leaves, and of jobs Slurm no longer knows. Bad input exits 2
before Slurm sees a job.
"""

import io
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

from plugins import run_status, sweep as sweep_lib
from plugins.sweep import slurm as slurm_lib
from plugins.sweep.spec import expand, parse_axis
from plugins.sweep.trial_process import THREAD_VARIABLES, write_json
from tests.conftest import REPO_ROOT, launcher_environment, read_events, run_modules
from tests.test_sweep import TINY, TensorBoard, attempt_header, read_tsv

# zip: two short trials, then one long enough to be training when the sweep is stopped.
AXES = ['train.seed=[0, 1, 2]', 'train.num_steps=[4, 6, 150]']
FIRST, SECOND, THIRD = (t.name for t in expand([parse_axis(a) for a in AXES], mode='zip'))


def sweep_command(root, *extra):
  return ['-m', 'launch.sweep', *TINY, '--sweep_mode=zip', *[f'--sweep={a}' for a in AXES],
          f'--model_dir={root}', '--launcher=slurm', '--parallel=2', *extra]


def job_states(cluster, job_ids):
  """{job id: state} as Slurm itself tells it (squeue lists finished jobs for 10 minutes)."""
  listed = cluster.command('squeue', '-h', '-t', 'all', '-o', '%i %T',
                           '-j', ','.join(job_ids)).stdout.split('\n')
  return dict(line.split() for line in listed if line.strip())


def all_jobs(cluster):
  """The ids of the jobs Slurm still lists. It forgets a finished job
  MinJobAge (tests/slurm.py: 600 s) after it ends, which a long shard
  passes, so compare with `new_jobs`, not for equality."""
  return set(cluster.command('squeue', '-h', '-t', 'all', '-o', '%i').stdout.split())


def new_jobs(cluster, before: set) -> set:
  """Jobs submitted since `before = all_jobs(cluster)` (ids only grow)."""
  return all_jobs(cluster) - before


def when(condition, then, timeout=60):
  """Runs `then()` in a thread once `condition()` holds, or after `timeout`
  seconds all the same (so the test's main thread is not left waiting).
  Returns a check that waits for the thread and fails the test if the
  condition never held: the action then came from the timeout."""
  held = []

  def watch():
    give_up = time.monotonic() + timeout
    while not held and time.monotonic() < give_up:
      if condition():
        held.append(True)
      else:
        time.sleep(0.1)
    then()

  thread = threading.Thread(target=watch, daemon=True)
  thread.start()

  def check():
    thread.join()
    assert held, f'{getattr(condition, "__name__", condition)} did not hold within {timeout} s'
  return check


def test_when_fails_the_test_if_its_condition_never_held():
  done = []
  check = when(lambda: False, lambda: done.append(True), timeout=0.3)
  with pytest.raises(AssertionError, match='did not hold within 0.3 s'):
    check()
  assert done  # the action ran all the same: the main thread was not left waiting
  when(lambda: True, lambda: None)()  # held: passes


def wait_for_status(trial_dir, process, status='running', timeout=120):
  give_up = time.monotonic() + timeout
  while True:
    recorded = run_status.read_run_status(trial_dir)
    if recorded is not None and recorded.status == status:
      return recorded
    assert process.poll() is None, f'the sweep ended (exit {process.returncode})'
    assert time.monotonic() < give_up, f'{trial_dir} never said {status!r}'
    time.sleep(0.2)


def test_a_stopped_slurm_sweep_saves_its_jobs_and_a_rerun_finishes_them(slurm,
                                                                      tmp_path):
  root = str(tmp_path / 'root')
  # The caller's own thread settings left out: a sweep passes those on as they
  # are, and what is checked below is that it divides none of its own for a job.
  env = slurm.environment(launcher_environment({name: None for name in THREAD_VARIABLES}))
  with open(tmp_path / 'first.out', 'w+') as out:
    sweep = subprocess.Popen([sys.executable, '-u', *sweep_command(root)], cwd=REPO_ROOT,
                             env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
      wait_for_status(os.path.join(root, THIRD), sweep)  # a short one has ended by now
      sweep.send_signal(signal.SIGTERM)
      sweep.wait(timeout=120)
    finally:
      if sweep.poll() is None:
        sweep.kill()
    out.seek(0)
    first_output = out.read()
  assert sweep.returncode == 4, first_output[-3000:]

  with open(os.path.join(root, 'sweep.json')) as f:
    recorded = json.load(f)
  assert recorded['launcher']['kind'] == 'slurm' and recorded['launcher']['tasks'] == 1
  jobs = {t['name']: t['slurm_job_ids'] for t in recorded['trials']}
  assert all(len(ids) == 1 for ids in jobs.values()), jobs
  # Cancel (the default): no job of the sweep is left queued or running.
  states = job_states(slurm, [ids[0] for ids in jobs.values()])
  assert set(states) == {ids[0] for ids in jobs.values()}, states
  assert not set(states.values()) & {'PENDING', 'RUNNING', 'COMPLETING'}, states
  assert sweep_lib.read_status(os.path.join(root, FIRST))['status'] == 'SUCCESS'
  stopped = os.path.join(root, THIRD)
  outcome = run_status.read_run_status(stopped)  # the trial's own word: saved, run me again
  assert (outcome.status, outcome.exit_code) == ('preempted', run_status.EXIT_REQUEUE)
  assert os.path.isdir(os.path.join(stopped, 'checkpoints', f'ckpt-{outcome.step}'))
  record = sweep_lib.read_status(stopped)
  assert (record['status'], record['exit_code'], record['outcome']) == (
      'INTERRUPTED', run_status.EXIT_REQUEUE, 'preempted')
  with open(os.path.join(stopped, slurm_lib.EXIT_FILE)) as f:  # the batch script's record
    assert f.read().split() == [record['slurm_job_id'], str(run_status.EXIT_REQUEUE)]
  header = attempt_header(open(os.path.join(stopped, sweep_lib.LOG_FILE)).read(), 1)
  assert header.endswith(f'--model_dir={stopped} --cluster=slurm'), header
  assert 'TF_NUM_INTRAOP_THREADS' not in header  # a job has its own CPUs: no division
  # The middle trial either finished before the stop or was stopped the same way.
  assert sweep_lib.read_status(os.path.join(root, SECOND))['status'] in (
      'SUCCESS', 'INTERRUPTED')

  # The same command again: the first trial is kept, the others continue.
  [rerun] = run_modules([tuple(sweep_command(root))[1:]],
                        envs=[{'SLURM_CONF': slurm.conf}], timeout=300)
  assert rerun.returncode == 0, rerun.stdout[-2000:] + rerun.stderr[-3000:]
  assert '1 already done (skipped), 2 to run' in rerun.stdout or (
      '2 already done (skipped), 1 to run' in rerun.stdout)
  first_log = open(os.path.join(root, FIRST, sweep_lib.LOG_FILE)).read()
  assert first_log.count('===== sweep attempt') == 1
  log = open(os.path.join(stopped, sweep_lib.LOG_FILE)).read()
  assert f'Resumed from' in log.split('sweep attempt 2')[1], log[-3000:]
  assert max(s for s, _ in read_events(stopped)['scalars']['train/loss']) == 150
  record = sweep_lib.read_status(stopped)
  assert (record['status'], record['attempts'], record['exit_code']) == ('SUCCESS', 2, 0)
  assert len(set(record['slurm_job_ids'])) == 2 and record['slurm_job_id'] == (
      record['slurm_job_ids'][-1])
  assert all(row['status'] == 'SUCCESS' for row in read_tsv(root))
  with TensorBoard(root) as board:
    _, groups = board.hparams(num_sessions=3)
  assert {name: g['sessions'][0]['status'] for name, g in groups.items()} == {
      FIRST: 'STATUS_SUCCESS', SECOND: 'STATUS_SUCCESS', THIRD: 'STATUS_SUCCESS'}


STAND_IN_TRIAL = """#!{python}
# Stands in for `python -m launch.train` on each task of a 2-task trial: notes
# its task, says it is running (task 0, as client 0 does), then waits for a
# file in its model_dir before it completes.
import os, sys, time
from plugins import run_status
model_dir = [a.split('=', 1)[1] for a in sys.argv if a.startswith('--model_dir=')][0]
assert '--cluster=slurm' in sys.argv
task = os.environ['SLURM_PROCID']
with open(os.path.join(model_dir, f'task-{{task}}-of-{{os.environ["SLURM_STEP_NUM_TASKS"]}}'),
          'w'):
  pass
record = run_status.RunStatusFile(model_dir, enabled=task == '0',
                                  attempt=os.environ.get(run_status.ATTEMPT_VARIABLE))
record.write(run_status.RUNNING, step=0)
while not os.path.exists(os.path.join(model_dir, 'release')):
  time.sleep(0.1)
record.write(run_status.COMPLETED, step=1, exit_code=0)
"""


def test_leave_exits_at_once_and_a_rerun_adopts_the_job_it_left(slurm, tmp_path):
  fake = tmp_path / 'fake_python'
  fake.write_text(STAND_IN_TRIAL.format(python=sys.executable))
  fake.chmod(0o755)
  sweep = sweep_lib.Sweep(root=str(tmp_path / 'root'),
                          gin_files=['configs/experiments/quickstart.gin'],
                          axes=[parse_axis('train.seed=[0]')])
  trial_dir = os.path.join(sweep.root, 'seed=0')
  environment = slurm.environment()

  def runner(out):
    launcher = slurm_lib.SlurmLauncher(on_stop='leave', tasks=2, environment=environment)
    return sweep_lib.SweepRunner(sweep, python=str(fake), out=out, environment=environment,
                                 launcher=launcher)

  def running():
    recorded = run_status.read_run_status(trial_dir)
    return recorded is not None and recorded.status == 'running'

  stopper = when(running, lambda: os.kill(os.getpid(), signal.SIGTERM))
  first = runner(io.StringIO())
  [record] = first.run()
  stopper()
  assert first.stop_signal == 'SIGTERM'
  job_id = record['slurm_job_id']
  assert record['status'] == 'RUNNING' and sweep_lib.read_status(trial_dir)['status'] == (
      'RUNNING')
  assert job_states(slurm, [job_id]) == {job_id: 'RUNNING'}  # left to Slurm

  jobs_before = all_jobs(slurm)
  out = io.StringIO()
  releaser = when(lambda: 'watching 1 trials' in out.getvalue(),
                  lambda: open(os.path.join(trial_dir, 'release'), 'w').close())
  [record] = runner(out).run()
  releaser()
  assert 'still queued or running from an earlier sweep: seed=0' in out.getvalue()
  assert (record['status'], record['attempts'], record['slurm_job_ids']) == (
      'SUCCESS', 1, [job_id]), record
  assert not new_jobs(slurm, jobs_before)  # watched, never submitted again
  assert open(os.path.join(trial_dir, sweep_lib.LOG_FILE)).read().count(
      '===== sweep attempt') == 1
  # A multi-task trial: one job step of 2 tasks, each a client (--cluster=slurm).
  assert {n for n in os.listdir(trial_dir) if n.startswith('task-')} == {
      'task-0-of-2', 'task-1-of-2'}


def test_an_adopted_job_slurm_no_longer_knows_has_ended(slurm, tmp_path):
  """Slurm forgets a job MinJobAge after it ends (squeue: "Invalid job id
  specified"); a trial an earlier sweep left running on such a job has ended,
  however long ago: its run_status.json says how (completed: kept), and with
  none it crashed (run again), as for any trial. Here the jobs are ids this
  Slurm never knew."""
  fake = tmp_path / 'fake_python'
  fake.write_text(STAND_IN_TRIAL.format(python=sys.executable))
  fake.chmod(0o755)
  environment = slurm.environment()
  jobs_before = all_jobs(slurm)
  for job_id, completed in (('67000001', True), ('67000002', False)):
    sweep = sweep_lib.Sweep(root=str(tmp_path / job_id),
                            gin_files=['configs/experiments/quickstart.gin'],
                            axes=[parse_axis('train.seed=[0]')])
    trial_dir = os.path.join(sweep.root, 'seed=0')
    os.makedirs(trial_dir)
    write_json(os.path.join(trial_dir, sweep_lib.STATUS_FILE), {
        'status': 'RUNNING', 'attempts': 1, 'base': sweep.base(), 'wall_seconds': 0.0,
        'slurm_job_id': job_id, 'slurm_job_ids': [job_id]})
    if completed:
      run_status.RunStatusFile(trial_dir).write(run_status.COMPLETED, step=1, exit_code=0)
    open(os.path.join(trial_dir, 'release'), 'w').close()  # a new attempt completes at once
    out = io.StringIO()
    runner = sweep_lib.SweepRunner(
        sweep, python=str(fake), out=out, environment=environment,
        launcher=slurm_lib.SlurmLauncher(on_stop='leave', environment=environment))
    returned = threading.Event()  # a job watched forever: stopped (leave) after 120 s
    guard = when(returned.is_set, lambda: returned.is_set() or os.kill(os.getpid(),
                                                                        signal.SIGTERM),
                 timeout=120)
    [record] = runner.run()
    returned.set()
    assert runner.stop_signal is None, out.getvalue()
    guard()
    verdict = 'success' if completed else 'failure'
    assert f'[sweep] {verdict} seed=0 (its job ended while no sweep was watching)' in (
        out.getvalue()), out.getvalue()
    if completed:  # kept as it is
      assert (record['status'], record['attempts'], record['slurm_job_ids']) == (
          'SUCCESS', 1, [job_id]), record
    else:  # crashed, so run again: a second attempt, a new job
      assert (record['status'], record['attempts'], record['slurm_job_ids'][0]) == (
          'SUCCESS', 2, job_id), record
      assert new_jobs(slurm, jobs_before) == {record['slurm_job_id']}


def test_bad_slurm_input_exits_2_before_any_job_is_submitted(slurm, tmp_path):
  before = all_jobs(slurm)
  conf = {'SLURM_CONF': slurm.conf}
  sweep_file = tmp_path / 'three_tasks.sweep'  # the Slurm settings from a sweep file
  sweep_file.write_text('launcher = slurm\nslurm_tasks = 3\nslurm_sbatch_arg = --nice=5\n')
  no_slurm, no_partition, bad_tasks = run_modules(
      [tuple(sweep_command(tmp_path / 'path'))[1:],
       tuple(sweep_command(tmp_path / 'partition', '--slurm_partition=nosuch'))[1:],
       ('launch.sweep', *TINY, f'--sweep_file={sweep_file}', '--sweep=train.seed=[0, 1]',
        f'--model_dir={tmp_path / "tasks"}')],
      envs=[dict(conf, PATH='/nonexistent'), conf, conf])
  for result in (no_slurm, no_partition, bad_tasks):
    assert result.returncode == 2, result.stderr[-3000:]
    assert 'Traceback' not in result.stderr
  assert re.search(r'Configuration error: sbatch, squeue, scancel not found on PATH '
                   r'\(/nonexistent\)', no_slurm.stderr), no_slurm.stderr
  assert 'invalid partition specified: nosuch' in no_partition.stderr, no_partition.stderr
  assert 'has a 2-device mesh (CPU mesh 2=2 (data=2)), which 3 tasks cannot share evenly' in (
      bad_tasks.stderr), (
      bad_tasks.stderr)
  assert not new_jobs(slurm, before)
  for name in ('path', 'partition', 'tasks'):
    assert not (tmp_path / name).exists()  # the sweep root it created is gone again
