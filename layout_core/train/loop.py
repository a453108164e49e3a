"""The training loop: one loop for every step engine.

    counters = Counters(mesh)
    engine = make_engine(model=lm, mesh=mesh, rules=rules, task=task,   # layout_core.run
                         optimizer=OptimizerConfig(), config=config, counters=counters)
    trainer = Trainer(engine=engine, counters=counters, task=task, config=config,
                      writer=SummaryWriter(model_dir), profile_dir=model_dir)
    result = trainer.train()     # logs progress, writes train/* and eval/* scalars

The engine (`layout_core.train.engine`) decides how a step runs (the whole mesh,
GPipe on sub-meshes, the SPMD stage axis); the loop owns everything around
the steps: the data position, progress logging, evaluation, the task's
metrics (`train/<name>`, `eval/<name>`), a warning for each batch that trains
nothing (`layout_core.train.trained_tokens`), summaries, text samples
(`samples/text`, through a `text_samples` callable it is given), profiling, and the
`after_step` hook through which the caller checkpoints and stops on a signal.
"""

from __future__ import annotations

import math
import time
from typing import Any, Callable, Mapping

import numpy as np
from absl import logging

from layout_core.errors import ConfigError
from layout_core.layout.scope import bytes_per_device, table_markdown
from layout_core.layout.variables import to_numpy
from layout_core.tasks import Task
from layout_core.tasks.objective import add_parts, numpy_sums, value_of
from layout_core.train.config import TrainConfig, TrainResult
from layout_core.train.engine import Counters, StepEngine
from layout_core.train.profiling import StepProfiler
from layout_core.train.summaries import NullWriter, SummaryWriter
from layout_core.train.trained_tokens import UntrainedBatches
from layout_core.train.usage import usage_scalars


class Trainer:
  """Runs `engine` from the counters' step to `config.num_steps`."""

  def __init__(self, *, engine: StepEngine, counters: Counters, task: Task,
               config: TrainConfig, writer: SummaryWriter | NullWriter | None = None,
               profile_dir: str | None = None, model_flops_per_step: float | None = None,
               peak_flops: float | None = None,
               text_samples: Callable[[Mapping[str, Any]], str] | None = None):
    """`model_flops_per_step` (train/model_flops_per_sec) and `peak_flops`, the
    whole mesh's peak FLOP/s (train/mfu), are left out of the scalars when None.
    `text_samples(engine.variables)`, markdown, is written to `samples/text`
    every `config.sample_every` steps (`layout_core.infer.text_samples`;
    every client calls it: decoding runs on the whole mesh)."""
    self.engine, self.counters, self.task, self.config = engine, counters, task, config
    self.text_samples = text_samples
    self.model_flops_per_step, self.peak_flops = model_flops_per_step, peak_flops
    self.writer = writer or NullWriter()
    self.profile_dir = profile_dir
    self._eval_data = None
    self.resume_data_state: dict | None = None  # a checkpoint's data_state.json
    self._reader = None
    self.last_eval_metrics: dict[str, float] = {}
    self._unchecked: list[tuple[int, object, object]] = []  # (step, loss, grad norm)
    self.untrained = UntrainedBatches(task)  # train batches with no trained token, warned

  def state(self) -> dict:
    """Everything a checkpoint must hold to continue exactly, with
    `data_state()` beside it.

    Random state needs no entry: initial weights and dropout are pure
    functions of (seed, path) and (seed, step)."""
    state = {'model': self.engine.model_state, 'optimizer': self.engine.optimizer,
             'counters': self.counters.module}
    return {name: part for name, part in state.items() if part is not None}

  def data_state(self) -> dict | None:
    """Where this client's input stands after the last step it trained (the
    reader's position per stream; None for a task whose position is the step)."""
    if self._reader is None:
      return self.resume_data_state
    state = self._reader.state()
    return None if state is None else {'train': state}

  def check_finite(self) -> None:
    """FloatingPointError naming the first step since the last check whose
    loss or gradient norm is not finite. Every step's pair stays on the
    device until a log step or a save asks (no host sync per step); a state
    whose steps all passed is finite, since finite gradients make a finite
    update. Called before every checkpoint, so none holds a diverged model."""
    unchecked, self._unchecked = self._unchecked, []
    for step, loss, grad_norm in unchecked:
      for name, tensor in (('train loss', loss), ('gradient norm', grad_norm)):
        value = float(to_numpy(tensor))
        if not np.isfinite(value):
          raise FloatingPointError(f'{name} is {value} at step {step}; lower '
                                   'optimizer.learning_rate, clip harder or check the data')

  @property
  def current_step(self) -> int:
    return self.counters.current_step

  def train_step(self, batch):
    """One optimizer step on a host batch: (loss, lr, grad_norm, metrics) tensors."""
    loss, metrics, grads = self.engine.loss_and_gradients(self.engine.pack(batch))
    lr, grad_norm = self.engine.apply_gradients(grads)
    return loss, lr, grad_norm, metrics

  def evaluate(self) -> tuple[float, dict[str, float]]:
    """The loss and task metrics of `config.eval_batches` held-out batches
    together (each a mean over all their trained tokens, or rows)."""
    if self._eval_data is None:
      reader = self.task.reader(split='eval', batch_size=self.config.batch_size,
                                rows=self.engine.client_rows(self.config.batch_size))
      self._eval_data = [self.engine.pack(next(reader))
                         for _ in range(self.config.eval_batches)]
    # The batches add their sums (trained tokens' losses and counts), and the
    # mean is taken once: a batch with few trained tokens weighs little.
    loss, metrics = add_parts([numpy_sums(self.engine.evaluate(packed), to_numpy)
                               for packed in self._eval_data], add=sum)
    return value_of(loss), {name: value_of(value) for name, value in metrics.items()}

  def write_layouts(self) -> str:
    """The layout table and the engine's records to TensorBoard; returns the table."""
    records = self.engine.layout_records
    table = table_markdown(records)
    self.writer.text(step=0, tag='layouts/variables', markdown=table)
    self.writer.scalars(step=0, values={
        'usage/params_total': sum(math.prod(r.shape) for r in records),
        'usage/param_bytes_per_device_max': bytes_per_device(records)})
    texts, scalars = self.engine.summaries()
    for tag, markdown in texts.items():
      self.writer.text(step=0, tag=tag, markdown=markdown)
    if scalars:
      self.writer.scalars(step=0, values=scalars)
    return table

  def train(self, *, after_step: Callable[[int], bool] | None = None) -> TrainResult:
    """Runs from the current step to `config.num_steps`.

    `after_step(step)` runs after every step (checkpointing); returning True
    stops training early (preemption)."""
    config = self.config
    start = self.current_step
    if self.task.reference_pending:
      raise ConfigError('the preference task\'s precomputed reference log-probabilities are '
                        'not attached yet', where='dpo.precompute_reference',
                        fix='call layout_core.train.reference_logps.attach_reference(task, '
                            'engine, ...) before training (launch.train does)')
    eval_losses = []
    if start == 0:
      eval_losses.append((0, self._run_eval(0)))
    saved = (self.resume_data_state or {}).get('train') if start else None
    self._reader = batches = self.task.reader(
        split='train', batch_size=config.batch_size,
        rows=self.engine.client_rows(config.batch_size),
        start_step=int(to_numpy(self.counters.data_position)), state=saved)
    if hasattr(batches, 'describe'):
      logging.info('Training data: %s', batches.describe())
    tokens = self.task.tokens_per_example
    items_per_step = config.batch_size * tokens
    unit = 'tokens' if tokens > 1 else 'examples'
    loss_value, window_start, window_steps = None, time.perf_counter(), 0
    stopped_early = False
    run_start, steps_per_sec = time.perf_counter(), 0.0
    logging.info('Training steps %d..%d, global batch %d%s', start, config.num_steps,
                 config.batch_size, f' x {tokens} tokens' if tokens > 1 else ' examples')
    if start and not self.task.deterministic:
      logging.warning('Resuming at step %d on a task whose batches are not a pure '
                      'function of the step (%s): the data continues from where its '
                      'iterate() starts, not bit-exactly', start, self.task.describe())
    profiler = StepProfiler(logdir=self.profile_dir, steps=config.profile_steps)
    for step in range(start, config.num_steps):
      profiler.before_step(step)
      batch = next(batches)
      self.untrained.see(step=step, batch=batch, reader=batches)
      loss, lr, grad_norm, metrics = self.train_step(batch)
      profiler.after_step(step, loss)
      window_steps += 1
      done = step + 1
      last = done == config.num_steps
      self._unchecked.append((done, loss, grad_norm))
      if done % config.log_every == 0 or last:
        self.check_finite()
        loss_value = float(to_numpy(loss))
        elapsed = time.perf_counter() - window_start
        steps_per_sec = window_steps / max(elapsed, 1e-9)
        eta = (config.num_steps - done) / max(steps_per_sec, 1e-9)
        shown = ''.join(f'  {name} {float(to_numpy(metrics[name])):.4f}'
                        for name in self.task.console_metrics if name in metrics)
        logging.info('step %d/%d  loss %.4f%s  lr %.2e  |g| %.3f  %s steps/s  '
                     '%.0f %s/s  ETA %s', done, config.num_steps, loss_value, shown,
                     float(to_numpy(lr)), float(to_numpy(grad_norm)), _format_rate(steps_per_sec),
                     steps_per_sec * items_per_step, unit, _format_seconds(eta))
        self.writer.scalars(step=done, values={
            'train/loss': loss_value,
            'train/learning_rate': float(to_numpy(lr)),
            'train/grad_norm': float(to_numpy(grad_norm)),
            'train/steps_per_sec': steps_per_sec,
            'train/examples_per_sec': steps_per_sec * config.batch_size,
            **({'train/tokens_per_sec': steps_per_sec * items_per_step} if tokens > 1 else {}),
            **{f'train/{name}': float(to_numpy(value)) for name, value in metrics.items()},
            **usage_scalars(mesh=self.engine.mesh, steps_per_sec=steps_per_sec,
                            model_flops_per_step=self.model_flops_per_step,
                            peak_flops=self.peak_flops)})
        window_start, window_steps = time.perf_counter(), 0
      if last or (config.eval_every and done % config.eval_every == 0):
        eval_losses.append((done, self._run_eval(done)))
      if self.text_samples is not None and config.sample_every and (
          done % config.sample_every == 0):
        self.writer.text(step=done, tag='samples/text',
                         markdown=self.text_samples(self.engine.variables))
      if after_step is not None and after_step(done):
        stopped_early = True
        break
    else:
      done = max(start, config.num_steps)
    profiler.close()
    self.writer.flush()
    total = time.perf_counter() - run_start
    overall = (done - start) / total if total > 0 else 0.0
    return TrainResult(final_step=done, train_loss=loss_value, eval_losses=eval_losses,
                       steps_per_sec=overall or steps_per_sec,
                       eval_metrics=self.last_eval_metrics, stopped_early=stopped_early,
                       start_step=start)

  def _run_eval(self, step: int) -> float:
    value, metrics = self.evaluate()
    self.last_eval_metrics = {'loss': value, **metrics}
    logging.info('eval at step %d: loss %.4f%s', step, value,
                 ''.join(f'  {n} {v:.4f}' for n, v in metrics.items()))
    self.writer.scalars(step=step, values={
        'eval/loss': value, **{f'eval/{n}': v for n, v in metrics.items()}})
    return value


def _format_rate(per_second: float) -> str:
  """Steps a second to 2 decimals, 4 below 1 (never an exponent): the
  step times read back from the log (`launch.inspect --suggest --measure`,
  bench/calibrate.py) kept only 0.05 of a 20 s step, +-10%."""
  return f'{per_second:.2f}' if per_second >= 1 else f'{per_second:.4f}'


def _format_seconds(seconds: float) -> str:
  seconds = int(seconds)
  return f'{seconds // 3600:d}:{seconds // 60 % 60:02d}:{seconds % 60:02d}'
