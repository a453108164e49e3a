"""The training loop: a model built in a layout scope, trained with tf.function.

    trainer = Trainer(model_params=lm, mesh=mesh, rules=rules, task=task,
                      optimizer=OptimizerConfig(), config=TrainConfig(num_steps=300),
                      writer=SummaryWriter(model_dir))
    result = trainer.train()     # logs progress, writes train/* and eval/* scalars

The global batch is packed onto the mesh sharded over `config.batch_axis`
(each device receives only its slice); parameters and optimizer slots carry
the layouts the rules gave them, and DTensor inserts the collectives.

The model is a Params tree (meshgin layers, built in a `LayoutScope`) or a
`layout_core.model.keras.KerasModel` (a Keras 3 model built with the same
rules); the task (`layout_core.tasks.Task`) supplies batches, the model's
inputs, the loss and extra metrics (`train/<name>`, `eval/<name>`).
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Callable

import numpy as np
from absl import logging

from layout_core.lazy import tf, dtensor
from layout_core.layout import mesh as mesh_lib
from layout_core.errors import ConfigError
from layout_core.fields import at_least, check_types
from layout_core.model.random import random_context, step_seed
from layout_core.layout.scope import LayoutScope, table_markdown
from layout_core.train.optimizer import Adam, OptimizerConfig
from layout_core.params import Params
from layout_core.train.profiling import StepProfiler
from layout_core.layout.rules import UNSHARDED, LayoutRules
from layout_core.train.summaries import NullWriter, SummaryWriter
from layout_core.tasks import Task, softmax_cross_entropy
from layout_core.layout.variables import to_numpy


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
    check_types(self, name='train')
    at_least(self, 'train', num_steps=1, batch_size=1, log_every=1, eval_batches=1,
             eval_every=0, seed=0)
    if self.profile_steps is not None:
      steps = tuple(self.profile_steps)
      if not 0 <= steps[0] < steps[1]:
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
  return softmax_cross_entropy(logits, labels)


class Trainer:
  """Builds the model and optimizer on `mesh` and runs the training loop."""

  def __init__(self, *, model_params, mesh: dtensor.Mesh,
               rules: LayoutRules | None, task: Task,
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
    self.batch_axis = batch_axis
    self.batch_layout = dtensor.Layout([batch_axis, UNSHARDED], mesh)

    if isinstance(model_params, Params):
      model_params = model_params.Copy().Freeze()
    self.model_params = model_params
    self.model, scope = self.build_model(model_params, rules)
    self.layout_records = scope.records
    self.variables = scope.variables
    # What the checkpoint holds as 'model': the module tree of a Params model,
    # the variables by Keras path for a Keras model.
    self.model_state = getattr(scope, 'checkpoint_root', self.model)
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
    # A step is two functions: the gradients (also what `check_runs` compiles
    # and runs before training) and the update.
    self._gradients = tf.function(self._gradients_fn)
    self._apply = tf.function(self._apply_fn)
    self._eval_step = tf.function(self.loss)
    self._eval_metrics_step = tf.function(self.loss_and_metrics)
    self._eval_data = None

  def build_model(self, params, rules: LayoutRules | None):
    """Instantiates `params` with every variable laid out on the mesh;
    returns (model, scope with the layout records and variables)."""
    if not isinstance(params, Params):  # a Keras model (layout_core.model.keras)
      from layout_core.model import keras as keras_models  # pylint: disable=g-import-not-at-top
      built = keras_models.build(params, mesh=self.mesh, rules=rules,
                                 seed=self.config.seed,
                                 input_specs=self.task.input_specs(self.config.batch_size))
      return built.model, built
    with LayoutScope(mesh=self.mesh, rules=rules, seed=self.config.seed) as scope:
      model = params.Instantiate()
    return model, scope

  # -- steps --------------------------------------------------------------------
  def forward(self, inputs, *, training: bool):
    """The model's outputs for the task's model inputs."""
    if isinstance(self.model_params, Params):
      return self.model(*inputs)
    return self.model(inputs[0] if len(inputs) == 1 else list(inputs), training=training)

  def loss_and_metrics(self, batch, *, training: bool = False):
    outputs = self.forward(self.task.model_inputs(batch), training=training)
    return self.task.loss_and_metrics(outputs, batch)

  def loss(self, batch) -> tf.Tensor:
    return self.loss_and_metrics(batch)[0]

  def _gradients_fn(self, batch):
    seed = step_seed(self.config.seed, self.step.read_value())
    with tf.GradientTape() as tape, random_context(seed=seed):
      loss, metrics = self.loss_and_metrics(batch, training=True)
    # Dense gradients: an embedding's IndexedSlices gradient passed on to the
    # update function arrives with a wrong shape under DTensor (TF 2.21).
    grads = [tf.convert_to_tensor(g) for g in tape.gradient(loss, self._trainable)]
    return loss, metrics, grads

  def _apply_fn(self, grads):
    lr, grad_norm = self.optimizer.apply(grads, self.step.read_value())
    self.step.assign_add(1)
    self.data_position.assign_add(1)
    return lr, grad_norm

  def loss_and_gradients(self, packed):
    """(loss, metrics, gradients) of one packed batch with this step's dropout
    masks, updating nothing."""
    return self._gradients(packed)

  def check_runs(self) -> None:
    """Runs forward and backward once on a real batch, updating nothing.

    Some layouts pass every rank/axis/divisibility check and still cannot be
    compiled by DTensor (it fails at the first step, deep inside TF). This
    makes that happen before training starts, as a ConfigError naming the
    sharded variables and their rules. It compiles the same function the
    training steps then use, so it costs one step, not a compile."""
    packed = self.pack(self.task.features(split='eval', step=0,
                                          batch_size=self.config.batch_size))
    try:
      loss = self.loss_and_gradients(packed)[0]
      to_numpy(loss)  # DTensor errors are asynchronous: wait for the values
    except (tf.errors.OpError, ValueError) as e:
      raise unrunnable_layout_error(e, self.layout_records) from None

  def pack(self, batch):
    """A host batch placed on the devices, each feature split over the batch
    axis (each device gets only its slice). A bare array is an LM's tokens."""
    if isinstance(batch, np.ndarray):
      batch = {'tokens': batch}
    return {name: mesh_lib.pack_global_array(
        value, dtensor.Layout([self.batch_axis] + [UNSHARDED] * (value.ndim - 1), self.mesh))
            for name, value in batch.items()}

  def train_step(self, batch):
    """One optimizer step on a host batch; returns (loss, lr, grad_norm) tensors."""
    return self.train_step_with_metrics(batch)[:3]

  def train_step_with_metrics(self, batch):
    """As `train_step`, plus the task's metrics {name: tensor}."""
    loss, metrics, grads = self._gradients(self.pack(batch))
    lr, grad_norm = self._apply(grads)
    return loss, lr, grad_norm, metrics

  def eval_loss(self, packed) -> tf.Tensor:
    return self.eval_loss_and_metrics(packed)[0]

  def eval_loss_and_metrics(self, packed):
    return self._eval_metrics_step(packed)

  def evaluate(self) -> float:
    """Mean loss over `config.eval_batches` held-out batches."""
    return self.evaluate_with_metrics()[0]

  def evaluate_with_metrics(self) -> tuple[float, dict[str, float]]:
    """Mean loss and mean task metrics over the held-out batches."""
    if self._eval_data is None:
      self._eval_data = [
          self.pack(self.task.features(split='eval', step=i,
                                       batch_size=self.config.batch_size))
          for i in range(self.config.eval_batches)]
    losses, metrics = [], {}
    for packed in self._eval_data:
      loss, values = self.eval_loss_and_metrics(packed)
      losses.append(float(to_numpy(loss)))
      for name, value in values.items():
        metrics.setdefault(name, []).append(float(to_numpy(value)))
    return float(np.mean(losses)), {n: float(np.mean(v)) for n, v in metrics.items()}

  def state(self) -> dict[str, tf.Module]:
    """Everything a checkpoint must hold to continue exactly.

    Random state needs no entry: initial weights and data are pure functions
    of (seed, path) and (seed, step)."""
    counters = tf.Module(name='counters')
    counters.step, counters.data_position = self.step, self.data_position
    return {'model': self.model_state, 'optimizer': self.optimizer, 'counters': counters}

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
    tokens_per_step = config.batch_size * self.task.tokens_per_example
    loss_value, window_start, window_steps = None, time.perf_counter(), 0
    run_start, steps_per_sec = time.perf_counter(), 0.0
    logging.info('Training steps %d..%d, global batch %d x %d tokens', start,
                 config.num_steps, config.batch_size, self.task.tokens_per_example)
    if start and not self.task.deterministic:
      logging.warning('Resuming at step %d on a task whose batches are not a pure '
                      'function of the step (%s): the data continues from where its '
                      'iterate() starts, not bit-exactly', start, self.task.describe())
    profiler = StepProfiler(logdir=getattr(self.writer, 'logdir', None),
                            steps=config.profile_steps)
    for step in range(start, config.num_steps):
      profiler.before_step(step)
      loss, lr, grad_norm, metrics = self.train_step_with_metrics(next(batches))
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
            'train/tokens_per_sec': steps_per_sec * tokens_per_step,
            **{f'train/{name}': float(to_numpy(value)) for name, value in metrics.items()}})
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
    value, metrics = self.evaluate_with_metrics()
    logging.info('eval at step %d: loss %.4f%s', step, value,
                 ''.join(f'  {n} {v:.4f}' for n, v in metrics.items()))
    self.writer.scalars(step=step, values={
        'eval/loss': value, **{f'eval/{n}': v for n, v in metrics.items()}})
    return value


def unrunnable_layout_error(error: Exception, records) -> ConfigError:
  """A ConfigError for a model DTensor could not run with its layouts."""
  lines = [line.strip() for line in str(error).splitlines() if line.strip()]
  reason = next((line.split('error:', 1)[1].strip() for line in lines if 'error:' in line),
                lines[0] if lines else type(error).__name__)
  sharded = [r for r in records if any(a != UNSHARDED for a in r.spec)]
  listing = '; '.join(f"'{r.path}' {r.spec} by rule {r.source}" for r in sharded[:8])
  more = f'; ... {len(sharded) - 8} more' if len(sharded) > 8 else ''
  return ConfigError(
      f'DTensor cannot run this model with these layouts: {reason}',
      where=f'layout_rules.rules (sharded variables: {listing or "none"}{more})',
      fix='leave the dimension DTensor names unsharded (change that rule\'s spec or '
          'narrow its regex); launch.inspect shows every variable\'s layout')


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
