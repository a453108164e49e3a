"""Shared test set-up: 8 virtual CPU devices for the whole session.

Logical devices must exist before TensorFlow initialises, so they are created
at import time, before any test module runs an op. Tests that need another
device count run in a subprocess (see `run_module`).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from typing import Sequence

import gin
import pytest
import tensorflow as tf

from layout_core import tf_internals
from layout_core.layout.mesh import MeshSpec, build_mesh, configure_virtual_cpus
from tests import cpu_ledger
from tests.zygote import (Zygote, ZygoteUnavailable, close_session_zygote, run_to_end,
                          session_zygote)

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NUM_DEVICES = 8
# For a launched run whose property does not depend on the device count
# (resume, signals, eval, decode, precision): a data-parallel mesh of 2 CPU
# devices, still split and still DTensor. A run's first call of each step
# function compiles a copy per device, so 8 cost about twice the CPU: an 8-step
# quickstart in a fresh process, 20.4 CPU-s on data=8 and 12.5 on data=2
# (6.5 of each importing TensorFlow), the same eval loss (3.7399).
TWO_DEVICES = "--gin_bindings=mesh.shape = {'data': 2}"
# For an SPMD pipeline whose property is not about the 'data' axis: 4 devices,
# a stage per 2, 'model' splitting each stage's weights (8 cost about half again
# as much CPU: a step function compiles once per device).
SPMD_ON_FOUR = "--gin_bindings=mesh.shape = {'stage': 2, 'data': 1, 'model': 2}"
assert configure_virtual_cpus(NUM_DEVICES) >= NUM_DEVICES
# This process compiles hundreds of tiny step functions and runs each a few
# times, so compiling is most of its work, and Grappler's rewrites are about
# half of each compile (bench/grappler_compile_cost.py: three steps of a
# composition cell take 1.5-1.9x the CPU seconds with them, losses equal to
# 1e-7). Its meta optimizer is off here, in this process only: the math the
# in-process tests compare is the same, and every run a test launches
# (launch.train and the others, forked from the zygote or fresh) compiles
# with Grappler as a user's does, which is where its rewrites are tested
# (tests/test_tf_internals.py shows the one meshgin works around, in a
# process of its own).
tf.config.optimizer.set_experimental_options({'disable_meta_optimizer': True})
# This process builds meshes of every shape, in whatever order the tests run:
# DTensor's default all-gather lowering, decided before the first mesh (a
# one-axis first mesh would choose CollectiveGatherV2, then refuse 2-D ones).
tf_internals.lower_gathers_once(False, reason="the tests' shared process (tests/conftest.py)")


# The quick tier (`pytest -m "not slow"`, a few minutes, for iteration) leaves
# out what trains for real: whole modules of subprocess trainings, and the
# slow tests of otherwise quick modules. The full suite runs everything.
SLOW = {
    'test_data_runs': None, 'test_eval': None, 'test_export': None, 'test_launch': None,
    'test_mesh_tab': None,
    'test_multi_client': None, 'test_never_lose_work': None, 'test_own_model': None,
    'test_pipeline_clients': None, 'test_pipeline_launch': None, 'test_pipeline_spmd': None,
    'test_pipeline_training': None,
    'test_precision': None, 'test_resume': None, 'test_speed_paths': None, 'test_sweep': None,
    'test_sweep_slurm': None, 'test_wheel': None,
    'test_optimizer_state': None,
    'test_fsdp': {'test_fsdp_trains_as_the_same_run_with_whole_parameters',
                  'test_bfloat16_fsdp_stays_within_bfloat16_rounding_of_the_run_without_it'},
    'test_layout_scope': {'test_sharded_run_matches_replicated_run'},
    'test_lost_peer': {'test_a_killed_peer_ends_the_other_client_with_one_paragraph'},
    'test_pipeline': {'test_gpipe_training_on_sub_meshes_equals_plain_tf'},
    'test_decode': {'test_sample_every_writes_text_samples',
                    'test_decode_writes_jsonl_and_refuses_bad_input'},
    'test_lm_eval': {'test_lm_eval_runs_the_local_tasks_end_to_end',
                     'test_lm_eval_refuses_unknown_tasks_and_runs_without_text'},
    'test_hf_models': {'test_the_launchers_take_an_imported_run'},
    'test_tasks': {'test_resume_from_a_checkpoint_reads_exactly_the_same_batches',
                   'test_classifier_example_trains_end_to_end_from_gin'},
}  # module -> None (all of it) or the names of its slow tests


def pytest_collection_modifyitems(items):
  for item in items:
    module = item.module.__name__.rsplit('.', 1)[-1]
    if module in SLOW and (SLOW[module] is None or item.originalname in SLOW[module]):
      item.add_marker(pytest.mark.slow)


@pytest.fixture(scope='session')
def devices8() -> int:
  return NUM_DEVICES


@pytest.fixture(scope='session')
def mesh_data8(devices8):
  return build_mesh(MeshSpec(shape={'data': 8}))


@pytest.fixture(scope='session')
def mesh_data4(devices8):
  """A one-axis mesh of 4, for a test about a one-axis split but not its
  size: a step function compiles once per device, so about 40% less CPU
  than on data=8 (test_optimizer_state's one-axis test: 11.5 CPU-s
  against 18.6)."""
  return build_mesh(MeshSpec(shape={'data': 4}))


@pytest.fixture(scope='session')
def mesh_2x4(devices8):
  return build_mesh(MeshSpec(shape={'data': 2, 'model': 4}))


@pytest.fixture(scope='session')
def mesh_2x2(devices8):
  """'data' and 'model' both split, as on 2x4, for a test about neither's
  size: a step function compiles once per device, so a quarter less CPU."""
  return build_mesh(MeshSpec(shape={'data': 2, 'model': 2}))


@pytest.fixture(scope='session')
def slurm(tmp_path_factory):
  """A real one-node Slurm (tests/slurm.py), started when first asked for."""
  from tests.slurm import OneNodeSlurm  # pylint: disable=g-import-not-at-top
  with OneNodeSlurm(str(tmp_path_factory.mktemp('slurm'))) as cluster:
    yield cluster


@pytest.fixture(scope='session')
def classifier_data(tmp_path_factory) -> list[str]:
  """The classifier example's data (configs/experiments/classifier_tfrecord.gin
  reads it from a fixed path a user writes it to), written small into this
  session's tmp dir; the gin bindings that point the config at it."""
  from examples.classifier.write_data import write_blobs  # pylint: disable=g-import-not-at-top
  root = tmp_path_factory.mktemp('classifier_data')
  write_blobs(str(root), num_train=64, num_eval=16)
  return [f"tfrecord_task.train_files = '{root}/train-*.tfrecord'",
          f"tfrecord_task.eval_files = '{root}/eval-*.tfrecord'"]


@pytest.fixture(autouse=True)
def clean_gin():
  gin.clear_config()
  yield
  gin.clear_config()


def run_module(module: str, *args: str, timeout: float = 300, env: dict | None = None,
               fresh: bool = False) -> subprocess.CompletedProcess:
  """Runs `python -m module args...` from the repo root, capturing output.
  A None in `env` removes that variable (TF_CPP_MIN_LOG_LEVEL=None: the
  console a user gets, quieted by the launcher itself).

  The process is forked from the session's zygote (tests/zygote.py: an
  interpreter that has imported TensorFlow already) unless `env` changes
  what TensorFlow reads at import time, or `fresh`; then it is a fresh
  interpreter. A forked run ends with os._exit after its exit handlers, so
  only a fresh one goes through the interpreter's own shutdown, where a
  hang at exit would show."""
  full_env = launcher_environment(env)
  done = None if fresh else _from_zygote('run', [module, *args], env=full_env, timeout=timeout)
  return done if done is not None else _run_fresh([module, *args], env=full_env, timeout=timeout)


def _run_fresh(argv: list[str], *, env: dict, timeout: float) -> subprocess.CompletedProcess:
  """`subprocess.run([python, -m, *argv], capture_output=True, text=True)`,
  its CPU seconds entered in the ledger (tests/cpu_ledger.py)."""
  command = [sys.executable, '-m', *argv]

  def wait(limit: float) -> int:
    cpu = cpu_ledger.exited_cpu(process.pid, limit)
    if cpu is None:
      raise subprocess.TimeoutExpired(command, limit)
    cpu_ledger.add(cpu, argv, reaped_here=True)
    return process.wait()

  with subprocess.Popen(command, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE,
                        stderr=subprocess.PIPE, text=True) as process:
    return run_to_end(process, command, wait, timeout)


def launcher_environment(changes: dict | None = None) -> dict:
  """What a test's launcher runs with: this process's environment, the repo
  importable, TensorFlow's C++ logging quiet, then `changes` (a None value
  removes that variable)."""
  full = {**os.environ, 'PYTHONPATH': REPO_ROOT, 'TF_CPP_MIN_LOG_LEVEL': '2', **(changes or {})}
  return {name: value for name, value in full.items() if value is not None}


def _zygote() -> Zygote | None:
  """The session's zygote (None with MESHGIN_TEST_FRESH_PROCESSES=1)."""
  return session_zygote(launcher_environment())


def _from_zygote(method: str, argv: list[str], **kwargs):
  """`zygote.run` / `zygote.start` of `argv`, or None where the zygote
  started nothing (off, gone, or the environment differs at import)."""
  zygote = _zygote()
  try:
    return getattr(zygote, method)(argv, **kwargs) if zygote is not None else None
  except ZygoteUnavailable:
    return None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item):
  """Charges the test's file with the CPU seconds its test (and the fixtures it
  started) took, launched runs included (tests/cpu_ledger.py)."""
  before = cpu_ledger.seconds_so_far()
  yield
  cpu_ledger.charge(item.nodeid.split('::')[0],
                    cpu_ledger.seconds_so_far(test=item.nodeid) - before)


def pytest_sessionfinish():
  close_session_zygote()  # reaped, so its runs' CPU time counts as the session's
  if os.environ.get('MESHGIN_TEST_CPU_LOG'):
    cpu_ledger.write(os.environ['MESHGIN_TEST_CPU_LOG'])


def run_modules(calls: Sequence[tuple[str, ...]], *, envs: Sequence[dict | None] = (),
                workers: int = 2, timeout: float = 300) -> list[subprocess.CompletedProcess]:
  """`run_module(*call, env=env)` for each call (and its env, if given),
  `workers` at a time; the results in the order of `calls`.

  A launcher spends most of its start-up on one core (imports, parsing,
  tracing), so two at a time keep both cores busy: test modules that check
  several independent runs start them together in a module fixture."""
  envs = list(envs) or [None] * len(calls)
  with concurrent.futures.ThreadPoolExecutor(workers) as pool:
    return list(pool.map(lambda call, env: run_module(*call, timeout=timeout, env=env),
                         calls, envs))


class Launched:
  """`python -u -m module args...` from the repo root, its merged stdout and
  stderr collected line by line while it runs (tests that signal or watch it);
  forked from the session's zygote as in `run_module`."""

  def __init__(self, module: str, *args: str, label: str = 'process',
               new_session: bool = False, env: dict | None = None):
    env = launcher_environment(env)
    self.label = label
    self.process = _from_zygote('start', [module, *args], env=env, unbuffered=True,
                                new_session=new_session)
    if self.process is None:
      self.process = subprocess.Popen(
          [sys.executable, '-u', '-m', module, *args], cwd=REPO_ROOT, env=env,
          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
          start_new_session=new_session)
    self.lines: list[str] = []
    self._reader = threading.Thread(target=self._read, daemon=True)
    self._reader.start()

  def _read(self) -> None:
    for line in self.process.stdout:
      self.lines.append(line)

  @property
  def output(self) -> str:
    return ''.join(self.lines)

  def wait_for(self, pattern: str, timeout: float = 120) -> re.Match:
    """The first match of `pattern` in the output; AssertionError if the
    process ends, or `timeout` passes, without one."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
      match = re.search(pattern, self.output)
      if match:
        return match
      if self.process.poll() is not None and not self._reader.is_alive():
        break
      time.sleep(0.05)
    raise AssertionError(f'{self.label}: no {pattern!r}:\n{self.output[-3000:]}')

  def finish(self, timeout: float = 120) -> str:
    """Its whole output once it has ended; AssertionError with that output, and
    where every thread of it stood (SIGUSR2: `launch.install_start_up_handlers`),
    if it is still running `timeout` seconds on."""
    try:
      self.process.wait(timeout)
    except subprocess.TimeoutExpired:
      self.process.send_signal(signal.SIGUSR2)
      time.sleep(3)
      signals = [line for line in self.lines if re.search(
          r'SIG[A-Z0-9]+ received|Preempted|Current thread|Fatal Python', line)]
      raise AssertionError(f'{self.label} still running {timeout} s on; its lines about '
                           f'signals: {signals[:20]}\n{self.output[-6000:]}') from None
    self._reader.join(10)
    return self.output

  def stop_after(self, pattern: str, *, timeout: float = 120) -> str:
    """SIGTERM (a scheduler's preemption) once `pattern` shows; its whole output."""
    self.wait_for(pattern, timeout=timeout)
    self.process.send_signal(signal.SIGTERM)
    return self.finish(timeout=120)


@contextlib.contextmanager
def killed_if_left(*runs: Launched):
  """Whatever happens inside, no run outlives the block (a failed fixture
  leaves no trainer behind)."""
  try:
    yield runs
  finally:
    for run in runs:
      if run.process.poll() is None:
        run.process.kill()
        run.process.wait()


def train_trace(trainer, *, steps: int, batch_size: int, evaluate: bool = False) -> dict:
  """{'loss', 'grad_norm'}: a trainer's losses and gradient norms over `steps`
  steps of its task's train split (an update shows in the next step's loss),
  and 'eval': its evaluation loss afterwards if asked (else None)."""
  from layout_core.layout.variables import to_numpy  # pylint: disable=g-import-not-at-top
  reader = trainer.task.reader(split='train', batch_size=batch_size)
  losses, norms = [], []
  for _ in range(steps):
    loss, _, norm, _ = trainer.train_step(next(reader))
    losses.append(float(to_numpy(loss)))
    norms.append(float(to_numpy(norm)))
  return {'loss': losses, 'grad_norm': norms,
          'eval': trainer.evaluate()[0] if evaluate else None}


def read_events(logdir: str) -> dict:
  """{'scalars': {tag: [(step, value)]}, 'text': {tag: [str]}} from real event files."""
  from tensorboard.backend.event_processing import event_accumulator
  import tensorflow as tf
  acc = event_accumulator.EventAccumulator(
      logdir, size_guidance={event_accumulator.TENSORS: 0})
  acc.Reload()
  scalars, texts = {}, {}
  for tag in acc.Tags()['tensors']:
    for event in acc.Tensors(tag):
      value = tf.make_ndarray(event.tensor_proto)
      if value.size != 1:
        continue  # not a scalar or text: e.g. the empty tensor of an HParams record
      if value.dtype.kind in 'SUO':
        texts.setdefault(tag, []).append(
            value.item().decode() if isinstance(value.item(), bytes) else str(value.item()))
      else:
        scalars.setdefault(tag, []).append((event.step, float(value)))
  return {'scalars': scalars, 'text': texts}
