"""Several real client processes as one mesh: same result as one process,
checkpoints that cross between them, and faults that end in bounded time.

Every run is a real `launch.train` process (2 clients x 2 virtual CPU devices,
or 1 process x 4), on a Megatron-sharded 2x2 mesh ('data' across clients,
'model' within): what crosses processes is the same as on 2x4, and each
client compiles for half the devices (tests/conftest.TWO_DEVICES). Runs are
shared between tests through module fixtures, in this order: one process for
8 steps (the reference), 2 clients for 4 steps, then resumes across the two
kinds and the faults.
"""

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest
import tensorflow as tf

from plugins import run_status
from tests.conftest import REPO_ROOT, Launched, killed_if_left, read_events, run_module
from tests.numerics import assert_close

# Every saved tensor (weights and optimizer slots), relative to its own
# scale (tests/numerics.py): two clients sum across processes in another order.
# measured on 2x2: 9.6e-06 / 9.6e-06 / 9.6e-06 (default / no oneDNN / 1 thread; 7.9e-06 on 2x4), in
# Adam's second moments, whose scale is tiny (an absolute 1e-6 passed them unseen).
STATE = 1e-4

ARGS = ['--gin_file=configs/experiments/lm_2d.gin',
        "--gin_bindings=mesh.shape = {'data': 2, 'model': 2}",
        '--gin_bindings=transformer_lm.num_layers = 1',
        '--gin_bindings=transformer_lm.max_len = 16', '--gin_bindings=data.seq_len = 16',
        '--gin_bindings=train.batch_size = 8', '--gin_bindings=train.eval_batches = 1',
        '--gin_bindings=train.eval_every = 0', '--gin_bindings=train.log_every = 1',
        "--gin_bindings=optimizer.decay = 'constant'",
        '--gin_bindings=checkpoint.every_steps = 2', '--gin_bindings=checkpoint.keep = 10']


FSDP = '--gin_bindings=train.fsdp = True'
# launch.local_cluster's 2 clients, each with its half of ARGS' 2x2 mesh; the
# train arguments follow.
CLUSTER = ('launch.local_cluster', '--num_clients=2', '--devices_per_client=2', '--')


def steps(n):
  return f'--gin_bindings=train.num_steps = {n}'


def ckpt(model_dir, step):
  return os.path.join(model_dir, 'checkpoints', f'ckpt-{step}', 'ckpt')


def assert_same_state(prefix, reference):
  a, b = tf.train.load_checkpoint(prefix), tf.train.load_checkpoint(reference)
  keys = {k for k in b.get_variable_to_shape_map() if k.endswith('VARIABLE_VALUE')}
  assert keys == {k for k in a.get_variable_to_shape_map() if k.endswith('VARIABLE_VALUE')}
  for key in keys:
    assert_close(a.get_tensor(key), b.get_tensor(key), rel=STATE, what=f'state: {key}')


def copy_checkpoint(model_dir, step, target):
  os.makedirs(os.path.join(target, 'checkpoints'))
  shutil.copytree(os.path.dirname(ckpt(model_dir, step)),
                  os.path.dirname(ckpt(target, step)))


def free_cluster(count=2):
  from launch.local_cluster import free_ports
  return ','.join(f'localhost:{p}' for p in free_ports(count))


class Client(Launched):
  """One `launch.train` client in its own process group, output collected."""

  def __init__(self, client_id, cluster, *args):
    super().__init__('launch.train', *args, f'--cluster={cluster}',
                     f'--client_id={client_id}', label=f'client {client_id}',
                     new_session=True)
    self.client_id = client_id

  def exit_seconds(self, timeout):
    """Seconds until the process exits (AssertionError after `timeout`)."""
    start = time.monotonic()
    try:
      self.process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
      raise AssertionError(f'client {self.client_id} still running after {timeout} s:\n'
                           f'{self.output[-3000:]}') from None
    self._reader.join(timeout=5)
    return time.monotonic() - start

  def kill(self, signum=signal.SIGKILL):
    try:
      os.killpg(self.process.pid, signum)
    except ProcessLookupError:
      pass


def cleanup(clients):
  for client in clients:
    client.kill(signal.SIGKILL)
    client.process.wait()


def local_cluster(model_dir, *args, timeout=400):
  return run_module(*CLUSTER, *ARGS, *args, f'--model_dir={model_dir}', timeout=timeout)


@pytest.fixture(scope='module')
def runs(tmp_path_factory):
  """The module's shared runs, started together:
  * the reference: one process with 4 devices, 8 steps (checkpoints at 2, 4, 6, 8);
  * 2 clients x 2 devices through launch.local_cluster, preempted with SIGTERM
    (to the launcher, which forwards it) once step 4 is saved; with fully
    sharded parameters (`train.fsdp`: every weight split over 'data', i.e.
    across the clients, gathered at use), so it also checks FSDP across
    processes against the whole-parameter reference, and its checkpoints
    resuming without FSDP.
  Returns (reference model_dir, (two_clients model_dir, its output))."""
  reference_dir = str(tmp_path_factory.mktemp('reference'))
  reference_run = Launched('launch.train', *ARGS, steps(8), f'--model_dir={reference_dir}',
                           label='reference run')
  model_dir = str(tmp_path_factory.mktemp('two_clients'))
  launcher = Launched(*CLUSTER, *ARGS, steps(1000), f'--model_dir={model_dir}', FSDP,
                      label='launch.local_cluster')
  with killed_if_left(launcher, reference_run):
    output = launcher.stop_after(r'Saved checkpoint .*ckpt-4/ckpt', timeout=400)
    reference_output = reference_run.finish(timeout=400)
  assert reference_run.process.returncode == 0, reference_output[-3000:]
  assert launcher.process.returncode == 0, output[-4000:]
  return reference_dir, (model_dir, output)


@pytest.fixture(scope='module')
def reference(runs):
  return runs[0]


@pytest.fixture(scope='module')
def two_clients(runs):
  return runs[1]


def test_two_clients_equal_one_process_and_only_client_0_records(reference, two_clients):
  model_dir, output = two_clients
  for step in (2, 4):
    assert_same_state(ckpt(model_dir, step), ckpt(reference, step))
  assert '[client 0]' in output and '[client 1]' in output
  assert 'exit status per client: [0, 0]' in output
  assert [n for n in os.listdir(model_dir) if n.startswith('events.')]
  assert {'config.gin', 'params.txt', 'layouts.txt'} <= set(os.listdir(model_dir))
  events = read_events(model_dir)  # one writer: each step logged once
  logged = [s for s, _ in events['scalars']['train/loss']]
  assert logged == list(range(1, len(logged) + 1)) and len(logged) >= 4
  assert re.search(r'\[client 1\].*Joined: client 1 of 2, with 2 of', output)
  assert re.search(r"\[client 0\].*train.fsdp: \d+ of \d+ variables stored split over 'data'",
                   output)


def test_sigterm_stops_every_client_at_the_same_step_and_saves(two_clients):
  model_dir, output = two_clients
  stopped = {int(m.group(1)): int(m.group(2)) for m in re.finditer(
      r'\[client (\d)\] Preempted by .* at step (\d+): saved', output)}
  assert set(stopped) == {0, 1} and stopped[0] == stopped[1], output[-4000:]
  step = stopped[0]
  reader = tf.train.load_checkpoint(ckpt(model_dir, step))
  assert reader.get_tensor('counters/step/.ATTRIBUTES/VARIABLE_VALUE') == step


def test_two_client_checkpoint_resumes_in_one_process(tmp_path, reference, two_clients):
  copy_checkpoint(two_clients[0], 4, str(tmp_path))
  result = run_module('launch.train', *ARGS, steps(6), f'--model_dir={tmp_path}')
  assert result.returncode == 0, result.stderr[-3000:]
  assert re.search(r'Resumed from .*ckpt-4/ckpt at step 4', result.stderr)
  assert_same_state(ckpt(tmp_path, 6), ckpt(reference, 6))


def test_one_process_checkpoint_resumes_on_two_clients_then_a_dead_peer_stops_the_other(
    tmp_path, reference):
  """Resume 1 -> 2 clients; kill client 0 (the coordination leader) after
  step 6 is saved: client 1 exits non-zero within 30 s; relaunching both
  resumes from that last complete checkpoint and matches the reference."""
  model_dir = str(tmp_path)
  copy_checkpoint(reference, 4, model_dir)
  cluster = free_cluster()
  clients = [Client(k, cluster, *ARGS, steps(1000), f'--model_dir={model_dir}')
             for k in (0, 1)]
  try:
    clients[0].wait_for(r'Saved checkpoint .*ckpt-6/ckpt', timeout=300)
    assert re.search(r'Resumed from .*ckpt-4/ckpt at step 4', clients[1].output)
    clients[0].kill(signal.SIGKILL)
    seconds = clients[1].exit_seconds(timeout=30)
    assert clients[1].process.returncode != 0
    assert 'Client 1 of 2 failed' in clients[1].output, clients[1].output[-3000:]
    print(f'client 1 exited {seconds:.1f} s after its peer died')
  finally:
    cleanup(clients)
  assert_same_state(ckpt(model_dir, 6), ckpt(reference, 6))

  result = local_cluster(model_dir, steps(8))
  assert result.returncode == 0, result.stdout[-4000:]
  assert re.search(r'\[client 1\].*Resumed from .*ckpt-6/ckpt at step 6', result.stdout)
  assert_same_state(ckpt(model_dir, 8), ckpt(reference, 8))


def test_a_hung_peer_stops_the_other_within_30_seconds(tmp_path):
  cluster = free_cluster()
  clients = [Client(k, cluster, *ARGS, steps(1000), f'--model_dir={tmp_path}')
             for k in (0, 1)]
  try:
    clients[0].wait_for(r'step 2/1000', timeout=300)
    clients[1].kill(signal.SIGSTOP)
    seconds = clients[0].exit_seconds(timeout=30)
    assert clients[0].process.returncode != 0
    assert 'Client 0 of 2 failed' in clients[0].output, clients[0].output[-3000:]
    print(f'client 0 exited {seconds:.1f} s after its peer hung')
  finally:
    cleanup(clients)


def test_a_peer_that_never_starts_fails_within_the_init_timeout(tmp_path):
  cluster = free_cluster()
  client = Client(0, cluster, *ARGS, steps(4), f'--model_dir={tmp_path}',
                  '--cluster_init_timeout=5')
  try:
    seconds = client.exit_seconds(timeout=90)
  finally:
    cleanup([client])
  assert client.process.returncode != 0
  peer = cluster.split(',')[1]
  assert 'client 0 gave up after 5 s' in client.output
  assert f'not listening: client 1 ({peer})' in client.output, client.output[-2000:]
  print(f'exited {seconds:.1f} s after start (import + 5 s timeout)')


def test_bad_cluster_flags_exit_2(tmp_path):
  result = run_module('launch.train', *ARGS, f'--model_dir={tmp_path}',
                      '--cluster=localhost:9001,localhost:10000', '--client_id=0')
  assert result.returncode == 2
  assert 'not in sorted order' in result.stderr and '--cluster' in result.stderr
  result = run_module('launch.train', *ARGS, f'--model_dir={tmp_path}',
                      '--cluster=localhost:9001,localhost:9002', '--num_clients=3')
  assert result.returncode == 2 and '--num_clients=3' in result.stderr


def test_a_cluster_that_is_neither_a_scheduler_nor_addresses_exits_2(tmp_path):
  """A typo of a scheduler name is an error, not a run that trains alone."""
  model_dir = tmp_path / 'run'
  result = run_module('launch.train', *ARGS, steps(2), f'--model_dir={model_dir}',
                      '--cluster=slurmm')
  assert result.returncode == 2, result.stderr[-3000:]
  assert ("Configuration error: --cluster=slurmm: 'slurmm' is neither a scheduler (slurm, "
          "tf_config) nor a host:port address (did you mean 'slurm'?). Where: --cluster. "
          'Fix: give --cluster=slurm or --cluster=tf_config, or every client') in (
              ' '.join(result.stderr.split())), result.stderr[-3000:]
  assert 'Traceback' not in result.stderr
  assert not model_dir.exists()


def test_a_client_that_cannot_see_the_checkpoint_directory_is_named(tmp_path):
  """Client 1 given another --model_dir stands in for a host without the shared
  filesystem: both clients exit 2 naming client 1."""
  cluster = free_cluster()
  clients = [Client(k, cluster, *ARGS, steps(4), f'--model_dir={tmp_path / f"dir{k}"}')
             for k in (0, 1)]
  try:
    for client in clients:
      client.exit_seconds(timeout=300)
  finally:
    cleanup(clients)
  for client in clients:
    assert client.process.returncode == 2, client.output[-3000:]
    assert 'client(s) [1] cannot see the checkpoint directory' in client.output
    assert 'filesystem that every host mounts' in client.output


def test_cluster_spec_from_flags_or_dtensor_environment():
  from layout_core.layout.cluster import ClusterSpec
  from layout_core.errors import ConfigError
  env = {'DTENSOR_JOBS': 'h0:9000,h1:9000', 'DTENSOR_CLIENT_ID': '1'}
  spec = ClusterSpec.from_options(client_id=None, num_clients=None, cluster=[],
                                  init_timeout=120, environ=env)
  assert (spec.client_id, spec.addresses, spec.num_clients) == (1, ('h0:9000', 'h1:9000'), 2)
  flags_win = ClusterSpec.from_options(client_id=0, num_clients=2, cluster=['a:1', 'b:1'],
                                       init_timeout=5, environ=env)
  assert flags_win.addresses == ('a:1', 'b:1') and flags_win.client_id == 0
  single = ClusterSpec.from_options(client_id=None, num_clients=None, cluster=[],
                                    init_timeout=120, environ={})
  assert not single.is_multi_client
  with pytest.raises(ConfigError, match='client_id 2 is not in 0..1'):
    ClusterSpec.from_options(client_id=2, num_clients=None, cluster=['a:1', 'b:1'],
                             init_timeout=1, environ={})
  with pytest.raises(ConfigError, match='not host:port'):
    ClusterSpec(client_id=0, addresses=('a:1', 'b'))
  for cluster, close in ((['tf_confg'], "did you mean 'tf_config'"), (['a:1', 'slurm'], ''),
                         (['h0'], '')):
    with pytest.raises(ConfigError, match=f'neither a scheduler .*address.*{close}'):
      ClusterSpec.from_options(client_id=None, num_clients=None, cluster=cluster,
                               init_timeout=1, environ={})


# -- under a scheduler: Slurm (a real one-node Slurm) and TF_CONFIG ----------------------
SBATCH = os.path.join(REPO_ROOT, 'examples', 'slurm', 'train.sbatch')


def wait_until(check, *, timeout, what):
  give_up = time.monotonic() + timeout
  while not (value := check()):
    assert time.monotonic() < give_up, f'{what}: not within {timeout} s'
    time.sleep(0.1)
  return value


def tasks_exited(srun_log: str, code: int) -> set[int]:
  """The task ids srun reports as exited with `code`: "tasks 0-1: Exited ..." when
  they end together, one "task N: Exited ..." line each when they do not (under load)."""
  tasks = set()
  for first, last in re.findall(rf'tasks? (\d+)(?:-(\d+))?: Exited with exit code {code}\b',
                                srun_log):
    tasks.update(range(int(first), int(last or first) + 1))
  return tasks


def test_a_preempted_slurm_job_requeues_resumes_and_ends_as_one_process(
    tmp_path, reference, slurm):
  """examples/slurm/train.sbatch as a user submits it (its 2 tasks on this one
  node): `scancel --signal=TERM` while it trains -> both tasks save the same
  step and exit 143, the script requeues the job, which resumes at that step
  with nothing typed and ends with the one-process run's parameters; its
  preemption checkpoint resumes in one process too."""
  model_dir, log = str(tmp_path / 'run'), str(tmp_path / 'job.log')
  env = slurm.environment(dict(
      os.environ, MODEL_DIR=model_dir, PYTHONPATH=REPO_ROOT, TF_CPP_MIN_LOG_LEVEL='2',
      PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ['PATH']))
  submitted = subprocess.run(
      ['sbatch', '--parsable', '--nodes=1', '--ntasks-per-node=2', f'--output={log}',
       f'--chdir={REPO_ROOT}', SBATCH, *ARGS, steps(8)],
      env=env, capture_output=True, text=True, timeout=60)
  assert submitted.returncode == 0, submitted.stderr
  job = submitted.stdout.strip()
  read_log = lambda: open(log).read() if os.path.exists(log) else ''  # noqa: E731

  def preempted_step():
    status = run_status.read_run_status(model_dir)
    if status is None:
      return None
    if status.status == 'preempted':
      return status.step
    return status.attempts[0]['step'] if status.attempts else None  # requeued already

  one_process = str(tmp_path / 'one_process')
  try:
    wait_until(lambda: (run_status.read_run_status(model_dir) or ()) and
               run_status.read_run_status(model_dir).status == 'running',
               timeout=180, what=f'job {job} training\n{read_log()[-3000:]}')
    slurm.command('scancel', '--signal=TERM', job)
    step = wait_until(preempted_step, timeout=120, what=f'job {job} preempted\n{read_log()}')
    assert step < 8, 'the signal came too late to test a resume'
    # While Slurm requeues the job: its preemption checkpoint resumes in one process.
    copy_checkpoint(model_dir, step, one_process)
    resumed = Launched('launch.train', *ARGS, steps(8), f'--model_dir={one_process}',
                       label='one process')
    with killed_if_left(resumed):
      state = wait_until(lambda: (s := slurm.job_state(job)) in {
          'COMPLETED', 'FAILED', 'CANCELLED', 'TIMEOUT'} and s, timeout=240,
          what=f'job {job} done\n{read_log()[-3000:]}')
      resumed_output = resumed.finish(timeout=300)
  finally:
    slurm.command('scancel', job, check=False)
  output = read_log()
  assert state == 'COMPLETED', output[-4000:]
  stopped = [int(s) for s in re.findall(r'^Preempted by SIGTERM at step (\d+): saved',
                                        output, re.M)]
  assert stopped == [step, step], output[-4000:]  # both tasks, the same step
  assert tasks_exited(output, 143) == {0, 1}, output[-4000:]
  assert len(re.findall(rf'Resumed from .*ckpt-{step}/ckpt at step {step}', output)) == 2
  status = run_status.read_run_status(model_dir)
  assert (status.status, status.step, status.exit_code, status.restart_count) == (
      'completed', 8, 0, 1)
  assert [(a['status'], a['step'], a['exit_code'], a['restart_count'])
          for a in status.attempts] == [('preempted', step, 143, 0)]
  assert_same_state(ckpt(model_dir, 8), ckpt(reference, 8))

  assert resumed.process.returncode == 0, resumed_output[-3000:]
  assert re.search(rf'Resumed from .*ckpt-{step}/ckpt at step {step}', resumed_output)
  assert_same_state(ckpt(one_process, 8), ckpt(reference, 8))


def test_tf_config_workers_equal_one_process(tmp_path, reference):
  """Two workers started as a Kubernetes operator starts them: the same
  command, TF_CONFIG naming the cluster and each one's task. The workers are
  listed out of sorted order: client ids follow DTensor's sorted addresses."""
  low, high = free_cluster().split(',')
  workers = []
  for index in (0, 1):
    config = {'cluster': {'worker': [high, low]}, 'task': {'type': 'worker', 'index': index}}
    workers.append(Launched('launch.train', *ARGS, steps(2), f'--model_dir={tmp_path}',
                            '--cluster=tf_config', env={'TF_CONFIG': json.dumps(config)},
                            label=f'worker {index}', new_session=True))
  with killed_if_left(*workers):
    outputs = [w.finish(timeout=300) for w in workers]
  for worker, output in zip(workers, outputs):
    assert worker.process.returncode == 0, output[-3000:]
  assert 'Joined: client 1 of 2' in outputs[0] and 'Joined: client 0 of 2' in outputs[1]
  assert_same_state(ckpt(tmp_path, 2), ckpt(reference, 2))


def test_bfloat16_fsdp_on_two_clients_equals_one_process_without_it(tmp_path):
  """In bfloat16, FSDP moves a layer's matrices by all-to-all between the
  batch's replicas (`layout_core.layout.fsdp.per_replica`), here across the
  two processes; its gradients are those of a run without FSDP bit for bit,
  so 2 steps on 2 clients x 2 devices save what one process without FSDP does."""
  bf16 = "--gin_bindings=train.compute_dtype = 'bfloat16'"
  one, two = str(tmp_path / 'one'), str(tmp_path / 'two')
  runs = [Launched('launch.train', *ARGS, steps(2), bf16, f'--model_dir={one}',
                   label='one process, no fsdp'),
          Launched(*CLUSTER, *ARGS, steps(2), bf16, FSDP, f'--model_dir={two}',
                   label='2 clients, fsdp')]
  with killed_if_left(*runs):
    outputs = [run.finish(timeout=300) for run in runs]
  for run, output in zip(runs, outputs):
    assert run.process.returncode == 0, output[-3000:]
  assert 'exit status per client: [0, 0]' in outputs[1]
  assert_same_state(ckpt(two, 2), ckpt(one, 2))


def test_a_task_count_that_does_not_fit_the_mesh_or_no_allocation_exits_2(tmp_path, slurm):
  env = slurm.environment(dict(os.environ, PYTHONPATH=REPO_ROOT, TF_CPP_MIN_LOG_LEVEL='2'))
  result = subprocess.run(
      ['srun', '-n', '3', sys.executable, '-m', 'launch.train', *ARGS,
       f'--model_dir={tmp_path / "three"}', '--cluster=slurm'],
      cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=120)
  assert result.returncode == 2, result.stderr[-3000:]
  assert result.stderr.count('slurm gave 3 tasks') == 3, result.stderr[-3000:]
  assert 'needs 4 devices' in result.stderr and 'srun -n 2' in result.stderr
  assert not os.path.exists(tmp_path / 'three')

  result = run_module('launch.train', *ARGS, f'--model_dir={tmp_path / "outside"}',
                      '--cluster=slurm', env={k: None for k in env if k.startswith('SLURM_')})
  assert result.returncode == 2
  assert 'not inside a Slurm allocation' in result.stderr, result.stderr[-2000:]


def test_the_cluster_comes_from_slurm_variables_or_tf_config(slurm, monkeypatch):
  """Each task's client id is its address's place in the sorted list, whatever
  Slurm's rank or TF_CONFIG's index; bad or missing settings are exit-2 errors."""
  from layout_core.errors import ConfigError
  from layout_core.layout.cluster import ClusterSpec
  monkeypatch.setenv('SLURM_CONF', slurm.conf)  # scontrol expands the node list
  resolve = socket.getaddrinfo  # node1 and node2 stand for this host
  monkeypatch.setattr(socket, 'getaddrinfo', lambda host, *args, **kwargs: resolve(
      'localhost' if host in ('node1', 'node2') else host, *args, **kwargs))

  def spec(cluster, environ, **flags):
    options = dict(client_id=None, num_clients=None, init_timeout=5, port=None)
    options.update(flags)
    return ClusterSpec.from_options(cluster=[cluster], environ=environ, **options)

  # 2 nodes x 2 tasks, cyclic: rank 1 is the first task on node2.
  step = {'SLURM_JOB_ID': '7', 'SLURM_STEP_NUM_TASKS': '4', 'SLURM_NTASKS': '4',
          'SLURM_STEP_NODELIST': 'node[1-2]', 'SLURM_STEP_TASKS_PER_NODE': '2(x2)',
          'SLURMD_NODENAME': 'node2', 'SLURM_LOCALID': '0', 'SLURM_PROCID': '1'}
  task = spec('slurm', step, port=9000)
  assert task.addresses == ('node1:9000', 'node1:9001', 'node2:9000', 'node2:9001')
  assert (task.client_id, task.source, task.under_scheduler) == (2, 'slurm', True)
  single = spec('slurm', dict(step, SLURM_STEP_NUM_TASKS='1', SLURM_STEP_NODELIST='node2',
                              SLURM_STEP_TASKS_PER_NODE='1'))
  assert not single.is_multi_client and single.under_scheduler
  with pytest.raises(ConfigError, match='--client_id=0 but slurm makes this client 2 of 4'):
    spec('slurm', step, client_id=0)
  with pytest.raises(ConfigError, match='not inside a Slurm allocation'):
    spec('slurm', {})
  batch_script = {'SLURM_JOB_ID': '7', 'SLURM_NTASKS': '2'}
  with pytest.raises(ConfigError, match='not in a job step.*srun'):
    spec('slurm', batch_script)
  with pytest.raises(ConfigError, match='each task would train alone.*--cluster=slurm'):
    ClusterSpec.from_options(client_id=None, num_clients=None, cluster=[], init_timeout=5,
                             environ=step)

  kubernetes = {'cluster': {'chief': ['c:2222'], 'worker': ['w0:2222', 'w1:2222']},
                'task': {'type': 'worker', 'index': 1}}
  task = spec('tf_config', {'TF_CONFIG': json.dumps(kubernetes)})
  assert (task.client_id, task.addresses) == (2, ('c:2222', 'w0:2222', 'w1:2222'))
  with pytest.raises(ConfigError, match='TF_CONFIG is not set'):
    spec('tf_config', {})
  with pytest.raises(ConfigError, match='not a cluster and task'):
    spec('tf_config', {'TF_CONFIG': '{"cluster": {}}'})
  with pytest.raises(ConfigError, match='task type.*ps.*no parameter servers'):
    spec('tf_config', {'TF_CONFIG': json.dumps(dict(
        kubernetes, cluster=dict(kubernetes['cluster'], ps=['p:1'])))})
  with pytest.raises(ConfigError, match='worker 5 but the cluster lists 2'):
    spec('tf_config', {'TF_CONFIG': json.dumps(dict(
        kubernetes, task={'type': 'worker', 'index': 5}))})


def slurm_step(job_id, node='localhost', tasks=16):
  """The variables srun gives task 0 of `tasks` on one node."""
  return {'SLURM_JOB_ID': str(job_id), 'SLURM_STEP_NUM_TASKS': str(tasks),
          'SLURM_STEP_NODELIST': node, 'SLURM_STEP_TASKS_PER_NODE': str(tasks),
          'SLURMD_NODENAME': node, 'SLURM_LOCALID': '0'}


def test_ports_picked_from_the_slurm_job_id_avoid_this_hosts_ephemeral_ports(monkeypatch):
  """The kernel gives outgoing connections local ports from
  ip_local_port_range: a task must not be told to listen on one."""
  from layout_core.layout import scheduler
  monkeypatch.setattr(scheduler, 'expand_hostlist', lambda text: text.split(','))  # no scontrol
  with open('/proc/sys/net/ipv4/ip_local_port_range') as f:
    low, high = (int(n) for n in f.read().split())
  for job in [*range(0, 100000, 7), 2**31 - 1, 2**32 - 2]:
    _, addresses = scheduler.from_slurm(slurm_step(job))
    ports = [int(address.rpartition(':')[2]) for address in addresses]
    assert len(ports) == 16 and all(1024 <= p < low or high < p < 65536 for p in ports), (
        f'job {job}: ports {ports[0]}..{ports[-1]}, ephemeral {low}..{high}')


def test_a_slurm_node_name_that_does_not_resolve_is_named(monkeypatch):
  """An error naming it, not a cluster start that waits for a task no peer can reach."""
  from layout_core.errors import ConfigError
  from layout_core.layout import scheduler
  monkeypatch.setattr(scheduler, 'expand_hostlist', lambda text: text.split(','))  # no scontrol
  with pytest.raises(ConfigError) as raised:
    scheduler.from_slurm(slurm_step(7, node='no-such-node.invalid'))
  assert "SLURMD_NODENAME='no-such-node.invalid' does not resolve" in str(raised.value)
  assert raised.value.where == 'SLURMD_NODENAME' and '/etc/hosts' in raised.value.fix


def test_a_scheduler_stop_signal_is_a_clean_stop_that_asks_to_run_again():
  """SIGUSR1 (`sbatch --signal=USR1@120`) stops like SIGTERM; under a
  scheduler even a stop during start-up exits 143, so the job is queued again."""
  import launch
  from layout_core.train.preemption import PreemptionWatcher
  with PreemptionWatcher() as watcher:
    os.kill(os.getpid(), signal.SIGUSR1)
    wait_until(lambda: watcher.requested, timeout=5, what='SIGUSR1 seen')
  assert watcher.signal_name == 'SIGUSR1'
  assert launch.stopped_status(['train', '--cluster=slurm']) == run_status.EXIT_REQUEUE == 143
  assert launch.stopped_status(['train', '--cluster', 'tf_config']) == 143
  assert launch.stopped_status(['train', '--cluster=h0:9000,h1:9000']) == 0
  assert launch.stopped_status(['train']) == 0
