"""Shared test set-up: 8 virtual CPU devices for the whole session.

Logical devices must exist before TensorFlow initialises, so they are created
at import time, before any test module runs an op. Tests that need another
device count run in a subprocess (see `run_module`).
"""

from __future__ import annotations

import os
import subprocess
import sys

import gin
import pytest

from layout_core.mesh import MeshSpec, build_mesh, configure_virtual_cpus

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NUM_DEVICES = 8
assert configure_virtual_cpus(NUM_DEVICES) >= NUM_DEVICES


@pytest.fixture(scope='session')
def devices8() -> int:
  return NUM_DEVICES


@pytest.fixture(scope='session')
def mesh_data8(devices8):
  return build_mesh(MeshSpec(shape={'data': 8}))


@pytest.fixture(scope='session')
def mesh_2x4(devices8):
  return build_mesh(MeshSpec(shape={'data': 2, 'model': 4}))


@pytest.fixture(autouse=True)
def clean_gin():
  gin.clear_config()
  yield
  gin.clear_config()


def run_module(module: str, *args: str, timeout: float = 300,
               env: dict | None = None) -> subprocess.CompletedProcess:
  """Runs `python -m module args...` from the repo root, capturing output."""
  full_env = dict(os.environ, PYTHONPATH=REPO_ROOT, TF_CPP_MIN_LOG_LEVEL='2')
  full_env.update(env or {})
  return subprocess.run([sys.executable, '-m', module, *args], cwd=REPO_ROOT,
                        capture_output=True, text=True, timeout=timeout, env=full_env)


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
