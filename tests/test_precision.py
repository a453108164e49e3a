"""Memory and precision: gradient accumulation, rematerialization and bfloat16
compute, each against the same run without it (the independent reference),
and each with a positive control that fails if the feature did nothing:
accumulation must compute its losses on micro-steps of batch_size / k rows,
remat must trace the recomputed layers' math a second time in the backward."""

import collections

import json
import os
import sys

import numpy as np
import pytest

from layout_core.layout.mesh import MeshSpec, build_mesh
from layout_core.layout.rules import LayoutRules
from layout_core.layout.variables import to_numpy
from layout_core.model import keras as keras_models
from layout_core.model import layers
from layout_core.model.lm import transformer_lm_params
from layout_core.pipeline import PipelineConfig
from layout_core.tasks.lm import MarkovTask
from layout_core.train.config import TrainConfig
from layout_core.run import make_trainer
from layout_core.optim import OptimizerConfig
from tests.numerics import assert_close
from tests.conftest import REPO_ROOT, TWO_DEVICES, run_module, run_modules
from tests.test_layout_scope import MEGATRON

sys.path.insert(0, os.path.join(REPO_ROOT, 'tests', 'fixtures'))
from my_project import models, tasks  # noqa: E402  pylint: disable=g-import-not-at-top

BATCH = 8


def lm(dropout_rate=0.2):
  return transformer_lm_params(vocab_size=32, model_dim=32, num_heads=4, ffn_dim=64,
                               num_layers=2, max_len=16, dropout_rate=dropout_rate)


def trainer(mesh, *, rules=(), pipeline=None, model=None, task=None, **train):
  return make_trainer(
      model=model or lm(), mesh=mesh, rules=LayoutRules(list(rules)),
      task=task or MarkovTask(vocab_size=32, seq_len=16, seed=3),
      optimizer=OptimizerConfig(learning_rate=1e-2, warmup_steps=0),
      config=TrainConfig(num_steps=3, batch_size=BATCH, log_every=1, eval_every=0,
                         eval_batches=1, **train), pipeline=pipeline)


def values(variables):
  return {path: to_numpy(v) for path, v in variables.items()}


class RowRecordingTask(MarkovTask):
  """A MarkovTask that notes how many rows each loss it computes covers. A
  loss is computed in Python once per traced function, per micro-step and
  per pipeline micro-batch, so the notes taken while a step function is
  first traced show how the engine cut the batch."""

  def __init__(self, **kwargs):
    super().__init__(**kwargs)
    self.loss_rows: list[int] = []

  def loss_and_metrics(self, outputs, batch):
    self.loss_rows.append(int(outputs.shape[0]))
    return super().loss_and_metrics(outputs, batch)


@pytest.fixture
def traced_layers(monkeypatch):
  """A Counter of the layers' math run in Python, by layer ('ffn', 'softmax'):
  once per traced forward pass, once more for every recomputation (remat).
  The real layers run; only the counting is added."""
  counts = collections.Counter()
  ffn_apply = layers.FeedForward.apply.__func__
  softmax_fprop = layers.Softmax.fprop

  def counted_ffn(cls, p, w, x):
    counts['ffn'] += 1
    return ffn_apply(cls, p, w, x)

  def counted_softmax(self, x):
    counts['softmax'] += 1
    return softmax_fprop(self, x)
  monkeypatch.setattr(layers.FeedForward, 'apply', classmethod(counted_ffn))
  monkeypatch.setattr(layers.Softmax, 'fprop', counted_softmax)
  return counts


def traced_counts(counts: collections.Counter, run) -> collections.Counter:
  """What `counts` gained while `run()` ran (traced a function)."""
  before = collections.Counter(counts)
  run()
  return counts - before


@pytest.fixture(scope='module')
def stage_mesh(devices8):
  return build_mesh(MeshSpec(shape={'stage': 2, 'data': 2, 'model': 2}))


SETUPS = {  # name -> (mesh fixture, rules, pipeline)
    '2d': ('mesh_2x2', MEGATRON, None),
    'spmd': ('stage_mesh', MEGATRON, PipelineConfig(num_stages=2, num_micro_batches=2,
                                                    engine='spmd')),
    'gpipe': ('stage_mesh', MEGATRON, PipelineConfig(num_stages=2, num_micro_batches=2)),
}


@pytest.fixture(scope='module')
def float32_runs(request):
  """setup -> the float32, keep-everything trainer (built once; tests read its
  gradients and never step it)."""
  cache = {}

  def get(setup):
    if setup not in cache:
      mesh, rules, pipeline = SETUPS[setup]
      cache[setup] = trainer(request.getfixturevalue(mesh), rules=rules, pipeline=pipeline)
    return cache[setup]
  return get


@pytest.mark.parametrize('setup', ['2d', 'spmd', 'gpipe'])
def test_accumulated_micro_steps_equal_one_step_on_the_whole_batch(setup, request,
                                                                   float32_runs):
  """grad_accum_steps=2 (2 x 4 rows) against 1 (8 rows), with dropout (each
  row keeps its mask): the same loss, metrics and gradients, for a 2-D
  sharded mesh (data x model, Megatron rules) and both pipelined meshes; on
  the 2-D mesh also the same updated parameters and evaluation (the update
  and evaluation code is shared by all engines).

  Positive control (equal results are what ignoring grad_accum_steps would
  give too): every loss of the accumulated step covers a micro-step of 4
  rows (cut into the pipeline's 2 micro-batches of 2), not the whole batch."""
  mesh_name, rules, pipeline = SETUPS[setup]
  whole = float32_runs(setup) if setup != '2d' else trainer(request.getfixturevalue(mesh_name),
                                                            rules=rules)
  task = RowRecordingTask(vocab_size=32, seq_len=16, seed=3)
  accumulated = trainer(request.getfixturevalue(mesh_name), rules=rules, pipeline=pipeline,
                        task=task, grad_accum_steps=2)
  reference, accumulated_gradients = gradients(whole), gradients(accumulated)
  micro_batches = pipeline.num_micro_batches if pipeline else 1
  assert task.loss_rows and set(task.loss_rows) == {BATCH // 2 // micro_batches}, task.loss_rows
  # measured: - / 0 / 0 (default / no oneDNN / 1 thread)
  assert_close(accumulated_gradients[2], reference[2], rel=1e-06, what='accuracy')
  # measured: loss 0 / 0 / 0, gradients 2.4e-07 / 2.4e-07 / 2.4e-07 (default / no oneDNN /
  # 1 thread; the one-program engine on 2x2)
  assert_same_gradients(reference, accumulated_gradients, what='accumulated', loss_rel=3e-06,
                        gradients_rel=5e-06)
  if setup != '2d':
    return
  batch = {'tokens': whole.task.batch(step=0, batch_size=BATCH)}
  loss_a, _, norm_a, _ = whole.train_step(batch)
  loss_b, _, norm_b, _ = accumulated.train_step(batch)
  # measured: - / 0 / 0 (default / no oneDNN / 1 thread)
  assert_close(float(to_numpy(loss_b)), float(to_numpy(loss_a)), rel=1e-05,
               what='loss')
  # measured: - / 0 / 0 (default / no oneDNN / 1 thread)
  assert_close(float(to_numpy(norm_b)), float(to_numpy(norm_a)), rel=1e-05,
               what='grad norm')
  after_a, after_b = values(whole.engine.variables), values(accumulated.engine.variables)
  for path, value in after_a.items():
    # measured on 2x2: 2.4e-05 / 2.4e-05 / 2.4e-05 (default / no oneDNN / 1 thread; 9e-06 on 2x4):
    # Adam's first step divides each gradient by its own size
    assert_close(after_b[path], value, rel=0.0001, what=f'weights: {path}')
  (eval_a, _), (eval_b, _) = whole.evaluate(), accumulated.evaluate()
  # measured on 2x2: 0 / 0 / 0 (default / no oneDNN / 1 thread; 7e-08 on 2x4)
  assert_close(eval_b, eval_a, rel=1e-06, what='eval loss')


def gradients(t):
  """(loss, gradients, accuracy) of step 0's batch; nothing is updated."""
  loss, metrics, grads = t.engine.loss_and_gradients(
      t.engine.pack({'tokens': t.task.batch(step=0, batch_size=BATCH)}))
  if isinstance(grads, tuple):  # the sub-mesh engine: (per-stage lists, norms)
    grads = [g for stage in grads[0] for g in stage]
  return (float(to_numpy(loss)), [to_numpy(g) for g in grads],
          float(to_numpy(metrics['accuracy'])))


def assert_same_gradients(reference, other, *, what, loss_rel, gradients_rel):
  """`other`'s loss and each of its gradients within `loss_rel` and
  `gradients_rel` of `reference`'s, relative to their scale (tests/numerics.py);
  `what` starts each label, so each caller's comparisons are sites of their own."""
  assert_close(other[0], reference[0], rel=loss_rel, what=f'{what} loss')
  assert len(other[1]) == len(reference[1])
  for i, (a, b) in enumerate(zip(reference[1], other[1])):
    assert_close(b, a, rel=gradients_rel, what=f'{what} gradients: {i}')


@pytest.mark.parametrize('setup,policies', [('2d', ('block', 'full', 'none')),
                                             ('spmd', ('block',))])
def test_remat_gradients_equal_kept_activation_gradients(setup, policies, request,
                                                         float32_runs, traced_layers):
  """Recomputed blocks ('block') and layers ('full') give the gradients of
  the run that keeps every activation, dropout masks included (a recomputed
  block re-enters its forward pass's random context); for the SPMD engine the
  recomputed cells get their stacked weights as inputs.

  Positive control: the gradient function traces each recomputed layer's
  math twice (forward, then again in the backward) where the evaluation
  function, a forward pass alone, traces it once; with remat off ('none',
  checked once) both trace it once. 'block' recomputes the blocks'
  feed-forward layers, 'full' the softmax outside the blocks too."""
  mesh_name, rules, pipeline = SETUPS[setup]
  reference = gradients(float32_runs(setup))
  for policy in policies:
    run = trainer(request.getfixturevalue(mesh_name), rules=rules, pipeline=pipeline,
                  remat=policy)
    in_gradients = traced_counts(traced_layers, lambda: gradients(run))
    in_forward = traced_counts(traced_layers, lambda: to_numpy(run.evaluate()[0]))
    recomputed = {'none': (), 'block': ('ffn',), 'full': ('ffn', 'softmax')}[policy]
    for layer in ('ffn', 'softmax'):
      assert in_forward[layer] > 0, (policy, layer, in_forward)
      factor = 2 if layer in recomputed else 1
      assert in_gradients[layer] == factor * in_forward[layer], (policy, layer, in_gradients,
                                                                 in_forward)
    if policy != 'none':
      # measured: 0 / 0 (loss and gradients) (default / no oneDNN)
      assert_same_gradients(reference, gradients(run), what='remat', loss_rel=3e-07,
                            gradients_rel=1e-05)


def test_remat_keras_model_gradients_equal(mesh_2x2):
  def keras_trainer(**train):
    return trainer(mesh_2x2, model=keras_models.KerasModel(build_fn=models.token_classifier),
                   task=tasks.FirstTokenTask(), **train)

  def keras_gradients(t):
    packed = t.engine.pack(t.task.features(split='train', step=0, batch_size=BATCH))
    loss, _, grads = t.engine.loss_and_gradients(packed)
    return float(to_numpy(loss)), [to_numpy(g) for g in grads], None
  reference = keras_gradients(keras_trainer())
  remat = keras_trainer(remat='block')
  keras_layers = remat.engine.program.model.module.layers
  assert any(getattr(layer, '_remat_mode', None) for layer in keras_layers)
  # measured: 0 / 0 (loss and gradients) (default / no oneDNN)
  assert_same_gradients(reference, keras_gradients(remat), what='keras remat', loss_rel=1e-06,
                        gradients_rel=1e-05)


@pytest.mark.parametrize('setup', ['2d', 'spmd', 'gpipe', 'keras'])
def test_bfloat16_computes_in_bfloat16_and_keeps_float32_variables(setup, request,
                                                                   float32_runs):
  """bf16 math, float32 master weights and gradients, float32 loss: the loss
  and gradient norm stay close to the float32 run's (bf16 keeps 8 bits of
  mantissa)."""
  if setup == 'keras':
    kwargs = dict(mesh=request.getfixturevalue('mesh_2x2'), task=tasks.FirstTokenTask(),
                  model=keras_models.KerasModel(build_fn=models.token_classifier))
    full = trainer(**kwargs)
  else:
    mesh_name, rules, pipeline = SETUPS[setup]
    kwargs = dict(mesh=request.getfixturevalue(mesh_name), rules=rules, pipeline=pipeline)
    full = float32_runs(setup)
  half = trainer(**kwargs, compute_dtype='bfloat16')
  assert {v.dtype.name for v in half.engine.variables.values()} == {'float32'}
  features = full.task.features(split='train', step=0, batch_size=BATCH)
  loss_a, _, grads_a = full.engine.loss_and_gradients(full.engine.pack(features))
  loss_b, _, grads_b = half.engine.loss_and_gradients(half.engine.pack(features))
  assert loss_b.dtype.name == 'float32'
  if isinstance(grads_b, tuple):
    grads_a, grads_b = [g for s in grads_a[0] for g in s], [g for s in grads_b[0] for g in s]
  assert {g.dtype.name for g in grads_b} == {'float32'}
  # measured: 1.2e-05 / 1.2e-05 / 1.2e-05 (default / no oneDNN / 1 thread; the largest of
  # the four setups); the bounds of bf16 against float32
  # stay at bfloat16's rounding, since bf16 kernels differ most across CPUs
  assert_close(float(to_numpy(loss_b)), float(to_numpy(loss_a)), rel=2e-2, what='loss')
  assert float(to_numpy(loss_b)) != float(to_numpy(loss_a))  # it did compute in bf16
  norm = lambda gs: np.sqrt(sum(float(np.sum(to_numpy(g) ** 2)) for g in gs))
  # measured: 3.8e-03 / 3.8e-03 / 3.8e-03 (default / no oneDNN / 1 thread)
  assert_close(norm(grads_b), norm(grads_a), rel=5e-2, what='grad norm')


def test_bfloat16_quickstart_tracks_float32_and_its_checkpoint_resumes_in_float32(tmp_path):
  """30 quickstart steps (5 of warm-up) in bf16 against float32 (real
  launch.train runs): the final eval loss within 5%; then a float32 run
  resumes the bf16 run's checkpoint (float32 variables, the same keys) and
  goes on learning."""
  def command(model_dir, *bindings):
    return ('launch.train', '--gin_file=configs/experiments/quickstart.gin', TWO_DEVICES,
            f'--model_dir={model_dir}', '--gin_bindings=train.eval_every = 0',
            '--gin_bindings=checkpoint.every_steps = 0',
            '--gin_bindings=optimizer.warmup_steps = 5',  # learns within 30 steps (1.88)
            *[f'--gin_bindings={b}' for b in bindings])

  def status(result, model_dir):
    assert result.returncode == 0, result.stderr[-3000:]
    return json.load(open(os.path.join(model_dir, 'run_status.json')))

  def run(model_dir, *bindings):
    return status(run_module(*command(model_dir, *bindings)), model_dir)

  f32, bf16 = tmp_path / 'f32', tmp_path / 'bf16'
  results = run_modules([command(f32, 'train.num_steps = 30'),  # independent: together
                         command(bf16, 'train.num_steps = 30', "train.compute_dtype = 'bfloat16'")])
  full, half = status(results[0], f32), status(results[1], bf16)
  # measured: 1.6e-04 at 30 steps (1.8789 / 1.8792; 1.3e-03 at 60); bf16: see above
  assert_close(half['metrics']['eval_loss'], full['metrics']['eval_loss'], rel=0.05,
               what='eval loss')
  assert half['metrics']['eval_loss'] < 2.0  # it learned (uniform: ~4.16)
  resumed = run(tmp_path / 'bf16', 'train.num_steps = 35')
  assert resumed['step'] == 35 and resumed['status'] == 'completed'
  assert resumed['metrics']['eval_loss'] < 2.0
