"""The training loop: a model built in a layout scope, trained with tf.function.

    trainer = Trainer(model_params=lm, mesh=mesh, rules=rules, task=task,
                      optimizer=OptimizerConfig(), config=TrainConfig(num_steps=300),
                      writer=SummaryWriter(model_dir))
    result = trainer.train()     # logs progress, writes train/* and eval/* scalars

The global batch is packed onto the mesh sharded over `config.batch_axis`
(each device receives only its slice); parameters and optimizer slots carry
the layouts the rules gave them, and DTensor inserts the collectives.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Callable

import numpy as np
import tensorflow as tf
from absl import logging
from tensorflow.experimental import dtensor

from layout_core import mesh as mesh_lib
from layout_core.data import LMTask
from layout_core.errors import ConfigError
from layout_core.layers import random_context, step_seed
from layout_core.layout_scope import LayoutScope, table_markdown
from layout_core.optimizer import Adam, OptimizerConfig
from layout_core.params import Params
from layout_core.profiling import StepProfiler
from layout_core.rules import UNSHARDED, LayoutRules
from layout_core.summaries import NullWriter, SummaryWriter
from layout_core.variables import to_numpy


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  num_steps: int = 300       # total optimizer steps (a resumed run stops here too)
  batch_size: int = 32       # global batch, split over `batch_axis`
  eval_every: int = 100      # steps between evaluations; 0: only at start and end
  eval_batches: int = 4      # held-out batches per evaluation
  log_every: int = 25        # steps between progress lines / train scalars
  seed: int = 0              # initial weights (data has its own seed)
  batch_axis: str = 'data'   # mesh axis the batch is split over ('' for none)
  # (start, stop): a TensorFlow profiler trace of steps start..stop-1 (0-based)
  # into model_dir/plugins/profile, for TensorBoard's Profile tab; None: off.
  profile_steps: tuple[int, int] | None = None

  def __post_init__(self):
    for name in ('num_steps', 'batch_size', 'log_every', 'eval_batches'):
      if getattr(self, name) < 1:
        raise ConfigError(f'train.{name} is {getattr(self, name)}',
                          fix='use a positive integer')
    if self.profile_steps is not None:
      steps = tuple(self.profile_steps)
      if (len(steps) != 2 or not all(isinstance(s, int) for s in steps)
          or not 0 <= steps[0] < steps[1]):
        raise ConfigError(f'train.profile_steps is {self.profile_steps!r}',
                          where='train.profile_steps',
                          fix='give (start, stop) steps with 0 <= start < stop, e.g. (5, 8)')
      object.__setattr__(self, 'profile_steps', steps)


@dataclasses.dataclass
class TrainResult:
  final_step: int
  train_loss: float | None
  eval_losses: list[tuple[int, float]]  # (step, loss) per evaluation
  steps_per_sec: float


def cross_entropy(logits: tf.Tensor, labels: tf.Tensor) -> tf.Tensor:
  return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
      labels=labels, logits=logits))


class Trainer:
  """Builds the model and optimizer on `mesh` and runs the training loop."""

  def __init__(self, *, model_params: Params, mesh: dtensor.Mesh,
               rules: LayoutRules | None, task: LMTask,
               optimizer: OptimizerConfig, config: TrainConfig,
               writer: SummaryWriter | NullWriter | None = None):
    self.config = config
    self.task = task
    self.mesh = mesh
    self.writer = writer or NullWriter()
    axes = mesh_lib.mesh_axes(mesh)
    batch_axis = config.batch_axis if config.batch_axis in axes else UNSHARDED
    if config.batch_axis and config.batch_axis not in axes:
      logging.warning("train.batch_axis '%s' is not a mesh axis (%s): the batch "
                      'is replicated', config.batch_axis, list(axes))
    if batch_axis != UNSHARDED and config.batch_size % axes[batch_axis]:
      raise ConfigError(
          f'train.batch_size={config.batch_size} is not divisible by mesh axis '
          f"'{batch_axis}' of size {axes[batch_axis]}",
          fix=f'use a multiple of {axes[batch_axis]}')
    self.batch_layout = dtensor.Layout([batch_axis, UNSHARDED], mesh)

    model_params = model_params.Copy().Freeze()
    self.model_params = model_params
    self.model, scope = self.build_model(model_params, rules)
    self.layout_records = scope.records
    self.variables = scope.variables
    trainable = {p: v for p, v in self.variables.items() if v.trainable}
    self._trainable = list(trainable.values())
    self.step = dtensor.DVariable(
        dtensor.call_with_layout(tf.function(lambda: tf.zeros([], tf.int64)),
                                 dtensor.Layout.replicated(mesh, rank=0)),
        trainable=False, name='step')
    # The next batch to read; equal to `step` today, kept separately so a data
    # pipeline that skips or repeats batches stays resumable.
    self.data_position = dtensor.DVariable(
        dtensor.call_with_layout(tf.function(lambda: tf.zeros([], tf.int64)),
                                 dtensor.Layout.replicated(mesh, rank=0)),
        trainable=False, name='data_position')
    self.optimizer = Adam(optimizer, variables=self._trainable,
                          paths=list(trainable), total_steps=config.num_steps)
    self._train_step = tf.function(self._train_step_fn)
    self._eval_step = tf.function(self.loss)
    self._eval_data = None

  def build_model(self, params: Params, rules: LayoutRules | None):
    """Instantiates `params` with every variable laid out on the mesh;
    returns (model, scope with the layout records and variables)."""
    with LayoutScope(mesh=self.mesh, rules=rules, seed=self.config.seed) as scope:
      model = params.Instantiate()
    return model, scope

  # -- steps --------------------------------------------------------------------
  def loss(self, tokens: tf.Tensor) -> tf.Tensor:
    logits = self.model(tokens[:, :-1])
    return cross_entropy(logits, tokens[:, 1:])

  def _train_step_fn(self, tokens):
    seed = step_seed(self.config.seed, self.step.read_value())
    with tf.GradientTape() as tape, random_context(seed=seed):
      loss = self.loss(tokens)
    grads = tape.gradient(loss, self._trainable)
    lr, grad_norm = self.optimizer.apply(grads, self.step.read_value())
    self.step.assign_add(1)
    self.data_position.assign_add(1)
    return loss, lr, grad_norm

  def pack(self, tokens: np.ndarray):
    """A host batch [B, T+1] placed on the devices (each gets only its slice)."""
    return mesh_lib.pack_global_array(tokens, self.batch_layout)

  def train_step(self, tokens: np.ndarray):
    """One optimizer step on a host batch; returns (loss, lr, grad_norm) tensors."""
    return self._train_step(self.pack(tokens))

  def eval_loss(self, packed) -> tf.Tensor:
    return self._eval_step(packed)

  def evaluate(self) -> float:
    if self._eval_data is None:
      self._eval_data = [
          self.pack(self.task.batch(step=i, batch_size=self.config.batch_size,
                                    split='eval'))
          for i in range(self.config.eval_batches)]
    losses = [float(to_numpy(self.eval_loss(b))) for b in self._eval_data]
    return float(np.mean(losses))

  def state(self) -> dict[str, tf.Module]:
    """Everything a checkpoint must hold to continue exactly.

    Random state needs no entry: initial weights and data are pure functions
    of (seed, path) and (seed, step)."""
    counters = tf.Module(name='counters')
    counters.step, counters.data_position = self.step, self.data_position
    return {'model': self.model, 'optimizer': self.optimizer, 'counters': counters}

  @property
  def current_step(self) -> int:
    return int(to_numpy(self.step))

  def num_parameters(self) -> int:
    return sum(int(np.prod(v.shape)) for v in self.variables.values())

  # -- loop -----------------------------------------------------------------------
  def write_layouts(self) -> str:
    table = table_markdown(self.layout_records)
    self.writer.text(step=0, tag='layouts/variables', markdown=table)
    self.writer.scalars(step=0, values={
        'layouts/params_total': sum(math.prod(r.shape) for r in self.layout_records),
        'layouts/bytes_per_device_max': bytes_per_device(self.layout_records)})
    return table

  def train(self, *, after_step: Callable[[int], bool] | None = None) -> TrainResult:
    """Runs from the current step to `config.num_steps`.

    `after_step(step)` runs after every step (checkpointing); returning True
    stops training early (preemption)."""
    config = self.config
    start = self.current_step
    eval_losses = []
    if start == 0:
      eval_losses.append((0, self._run_eval(0)))
    batches = self.task.iterate(start_step=int(to_numpy(self.data_position)),
                                batch_size=config.batch_size)
    tokens_per_step = config.batch_size * self.task.seq_len
    loss_value, window_start, window_steps = None, time.perf_counter(), 0
    run_start, steps_per_sec = time.perf_counter(), 0.0
    logging.info('Training steps %d..%d, global batch %d x %d tokens', start,
                 config.num_steps, config.batch_size, self.task.seq_len)
    profiler = StepProfiler(logdir=getattr(self.writer, 'logdir', None),
                            steps=config.profile_steps)
    for step in range(start, config.num_steps):
      profiler.before_step(step)
      loss, lr, grad_norm = self.train_step(next(batches))
      profiler.after_step(step, loss)
      window_steps += 1
      done = step + 1
      last = done == config.num_steps
      if done % config.log_every == 0 or last:
        loss_value = float(to_numpy(loss))
        if not np.isfinite(loss_value):
          raise FloatingPointError(f'train loss is {loss_value} at step {done}; '
                                   'lower optimizer.learning_rate or clip harder')
        elapsed = time.perf_counter() - window_start
        steps_per_sec = window_steps / max(elapsed, 1e-9)
        eta = (config.num_steps - done) / max(steps_per_sec, 1e-9)
        logging.info('step %d/%d  loss %.4f  lr %.2e  |g| %.3f  %.2f steps/s  '
                     '%.0f tokens/s  ETA %s', done, config.num_steps, loss_value,
                     float(to_numpy(lr)), float(to_numpy(grad_norm)), steps_per_sec,
                     steps_per_sec * tokens_per_step, _format_seconds(eta))
        self.writer.scalars(step=done, values={
            'train/loss': loss_value,
            'train/learning_rate': float(to_numpy(lr)),
            'train/grad_norm': float(to_numpy(grad_norm)),
            'train/steps_per_sec': steps_per_sec,
            'train/tokens_per_sec': steps_per_sec * tokens_per_step})
        window_start, window_steps = time.perf_counter(), 0
      if last or (config.eval_every and done % config.eval_every == 0):
        eval_losses.append((done, self._run_eval(done)))
      if after_step is not None and after_step(done):
        break
    else:
      done = max(start, config.num_steps)
    profiler.close()
    self.writer.flush()
    total = time.perf_counter() - run_start
    overall = (done - start) / total if total > 0 else 0.0
    return TrainResult(final_step=done, train_loss=loss_value,
                       eval_losses=eval_losses, steps_per_sec=overall or steps_per_sec)

  def _run_eval(self, step: int) -> float:
    value = self.evaluate()
    logging.info('eval at step %d: loss %.4f', step, value)
    self.writer.scalars(step=step, values={'eval/loss': value})
    return value


def bytes_per_device(records) -> int:
  """Parameter bytes on the fullest device. DTensor shards evenly, so within a
  mesh all devices hold the same; with pipeline stages, the largest stage."""
  per_mesh: dict[str, int] = {}
  for r in records:
    per_mesh[r.mesh] = per_mesh.get(r.mesh, 0) + r.bytes_per_device
  return max(per_mesh.values(), default=0)


def _format_seconds(seconds: float) -> str:
  seconds = int(seconds)
  return f'{seconds // 3600:d}:{seconds // 60 % 60:02d}:{seconds % 60:02d}'
