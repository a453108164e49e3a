"""Step engines: how one training step runs, chosen once from the plan.

    counters = Counters(mesh)
    engine = make_engine(model=params, mesh=mesh, rules=rules, task=task,
                         optimizer=OptimizerConfig(), config=TrainConfig(),
                         counters=counters, pipeline=None)     # layout_core.run
    packed = engine.pack(task.features(split='train', step=0, batch_size=32))
    loss, metrics, grads = engine.loss_and_gradients(packed)
    lr, grad_norm = engine.apply_gradients(grads)               # advances the counters

An engine owns the model's variables and their layouts, the optimizer, and
the compiled step functions; the training loop (`layout_core.train.loop`)
only calls the protocol below, so every engine gets logging, evaluation,
checkpoints, preemption and summaries from the one loop. Implementations:

  * `SingleProgramEngine` (here): every step function is one SPMD program
    over the whole mesh (DTensor inserts the collectives): one compiled
    function for forward and backward, one for the update, one for
    evaluation. It runs a `ModelProgram` (a Params model or a Keras 3
    model, both arriving as a `layout_core.model.built.BuiltModel`) or the
    SPMD pipeline's `layout_core.pipeline.engines.SpmdProgram` (a stack of
    identical cells on the stage axis of one mesh);
  * `layout_core.pipeline.engines.GPipeEngine`: stages on sub-meshes.

Every function compiles with the process's all-gather lowering, decided
once when its first mesh was built (`layout_core.tf_internals`), so a
caller that drives an engine directly, as above, gets the same step as the
loop.
Gradient accumulation (`train.grad_accum_steps`) is `micro_steps.MicroSteps`
for every engine.
"""

from __future__ import annotations

from typing import Any, Mapping, Protocol, Sequence

import numpy as np

from layout_core.errors import ConfigError
from layout_core.lazy import dtensor, tf
from layout_core.layout import mesh as mesh_lib
from layout_core.layout.rules import UNSHARDED
from layout_core.layout.scope import LayoutRecord, initial_dtensor
from layout_core.layout.variables import Zeros, to_numpy
from layout_core.model.activations import residual_pin
from layout_core.model.base import as_float32
from layout_core.model import moe
from layout_core.model.built import BuiltModel, StepFunction
from layout_core.model.random import random_context, step_seed
from layout_core.step_context import SequenceInputs, StepContext, current, entered
from layout_core.tasks import Task
from layout_core.tasks.objective import finish
from layout_core.train.config import TrainConfig
from layout_core.train.micro_steps import MicroSteps, client_rows
from layout_core.optim import Optimizer, OptimizerConfig, make_optimizer


class StepEngine(Protocol):
  """What the training loop needs from a way of running a step."""
  mesh: Any                                 # the whole mesh (counters live on it)
  variables: Mapping[str, Any]              # path -> variable
  layout_records: Sequence[LayoutRecord]
  optimizer: Optimizer | None               # None: the weights only (an import)
  model_state: Any                          # what a checkpoint holds as 'model'
  description: str                          # the model as text (params.txt)

  def pack(self, batch: Mapping[str, np.ndarray]) -> Any:
    """A host batch placed on the devices, as this engine's step takes it."""

  def client_rows(self, batch_size: int) -> np.ndarray | None:
    """The global batch rows this client's devices hold (None: all of them),
    so a streaming task reads only those (`Task.reader(rows=...)`)."""

  def loss_and_gradients(self, packed) -> tuple[Any, dict[str, Any], Any]:
    """(loss, task metrics, gradients) of one packed batch with this step's
    dropout masks, updating nothing (also the dry step before training)."""

  def apply_gradients(self, gradients) -> tuple[Any, Any]:
    """The optimizer update, compiled under the mesh's gather lowering;
    advances the counters. Returns (lr, grad norm)."""

  def evaluate(self, packed) -> tuple[Any, dict[str, Any]]:
    """(loss, task metrics) of one packed batch, no dropout, as sums
    (`layout_core.tasks.objective`): the caller adds batches, then `finish`es."""

  def reference_features(self, batch: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The task's `reference_features` of the model as it is (forward only)
    on a host batch, per row: a reference precomputed from the starting model."""

  def summaries(self) -> tuple[dict[str, str], dict[str, float]]:
    """Extra TensorBoard records at step 0: ({tag: markdown}, {tag: scalar})."""


class Counters:
  """The step and the data position, replicated on `mesh`: what a checkpoint
  needs besides the variables to continue exactly. The data position is the
  next batch to read; equal to the step today, kept separately so a data
  pipeline that skips or repeats batches stays resumable."""

  def __init__(self, mesh):
    """`mesh` None: plain variables (a checkpoint written without a mesh: an import)."""
    def counter(name: str):
      if mesh is None:
        return tf.Variable(tf.zeros([], tf.int64), trainable=False, name=name)
      return dtensor.DVariable(
          initial_dtensor(Zeros(), shape=(), dtype=tf.int64, seed=0,
                          layout=dtensor.Layout.replicated(mesh, rank=0)),
          trainable=False, name=name)
    self.step, self.data_position = counter('step'), counter('data_position')
    self.module = tf.Module(name='counters')   # the checkpoint's 'counters'
    self.module.step, self.module.data_position = self.step, self.data_position

  def advance(self) -> None:
    """Inside an engine's update function: one step done, one batch read."""
    self.step.assign_add(1)
    self.data_position.assign_add(1)

  @property
  def current_step(self) -> int:
    return int(to_numpy(self.step))


class Program(Protocol):
  """What a `SingleProgramEngine` runs: a packed batch's loss and the task's metrics."""
  model: BuiltModel
  batch_axis: str   # the resolved batch axis (UNSHARDED: the batch is replicated)
  rows_parts: int   # equal consecutive parts `pack` cuts a batch into (micro-batches)

  def pack(self, batch: Mapping[str, np.ndarray]) -> Any:
    """A host batch placed on the devices as `loss_and_metrics` takes it."""

  def context(self, packed) -> StepContext:
    """The step context in force (`current()`, with the step's random state
    when training) plus what the model's math needs to know of this batch
    besides its inputs (packed segments, residual pin, batch split): what the
    engine enters around the forward and backward pass."""

  def loss_and_metrics(self, packed, training: bool = False) -> tuple[Any, dict[str, Any]]:
    """Traced inside the engine's functions, in `context(packed)`: the
    task's loss and metrics, as it returns them (sums or plain means,
    `layout_core.tasks.objective`)."""

  def reference_features(self, packed, adapters: bool = True) -> list[dict[str, Any]]:
    """Traced as `loss_and_metrics` is: the task's `reference_features` of
    the model, its LoRA adapters on or off, forward only, one dict per
    consecutive part of the batch's rows."""

  def summaries(self) -> tuple[dict[str, str], dict[str, float]]:
    """Extra TensorBoard records at step 0."""


class ModelProgram:
  """The model on the whole batch, split over `batch_axis`: the task's inputs
  -> a Params or Keras model -> the task's loss and metrics."""
  rows_parts = 1  # the batch in one piece

  def __init__(self, *, model: BuiltModel, task: Task, mesh, batch_axis: str):
    self.model, self.task, self.mesh, self.batch_axis = model, task, mesh, batch_axis

  def pack(self, batch):
    return pack_batch(batch, mesh=self.mesh, batch_axis=self.batch_axis)

  def context(self, packed):
    sequence = None
    if self.task.needs_segments:  # packed documents
      sequence = SequenceInputs(*self.task.sequence_inputs(packed))
    split = None if self.batch_axis == UNSHARDED else self.batch_axis
    return current().replace(sequence=sequence, batch_split=split,
                             residual=residual_pin(mesh=self.mesh, batch_axis=self.batch_axis))

  def loss_and_metrics(self, packed, training: bool = False):
    inputs = self.task.model_inputs(packed)
    if self.task.needs_reference:
      packed = {**packed, **self.task.reference_features(self._reference(inputs), packed)}
    with moe.collecting() as router_terms:  # a mixture of experts' aux losses and load
      outputs = self.model.call(inputs, training)
    return router_terms.added_to(*self.task.loss_and_metrics(as_float32(outputs), packed))

  def reference_features(self, packed, adapters: bool = True) -> list[dict[str, Any]]:
    """[the task's `reference_features` of the model on the batch, its LoRA
    adapters on (the starting model) or off]."""
    inputs = self.task.model_inputs(packed)
    return [self.task.reference_features(self._reference(inputs, adapters), packed)]

  def _reference(self, inputs, adapters: bool = False):
    """The reference model's outputs (a preference task's): the model with
    its LoRA adapters off (or on: `adapters`) and no dropout, out of the
    gradient. In a step it runs first, so that its activations are freed
    before the policy's are kept."""
    with entered(current().replace(adapters=adapters, random=None)):
      return tf.stop_gradient(as_float32(self.model.call(inputs, False)))

  def summaries(self):
    return {}, {}


class SingleProgramEngine:
  """Each step function one SPMD program on the whole mesh, DTensor inserting
  the collectives (module doc): a `ModelProgram` (Params or Keras model) or
  the SPMD pipeline's program (`layout_core.pipeline.engines.SpmdProgram`)."""

  def __init__(self, *, program: Program, mesh, optimizer: OptimizerConfig | None,
               config: TrainConfig, counters: Counters):
    """`optimizer` None: the model's weights only, nothing to update them
    (an import writes them as a step-0 checkpoint; training from it starts
    the optimizer fresh, `layout_core.checkpoint.manager`)."""
    self.program, self.mesh, self.config, self.counters = program, mesh, config, counters
    model = program.model
    self.variables, self.layout_records = model.variables, model.records
    self.model_state, self.description = model.checkpoint_root, model.description
    trainable = {p: v for p, v in model.variables.items() if v.trainable}
    self.trainable = list(trainable.values())
    self.optimizer = None if optimizer is None else make_optimizer(
        optimizer, variables=self.trainable, paths=list(trainable),
        total_steps=config.num_steps, mesh_axes=mesh_lib.mesh_axes(mesh),
        batch_axis=program.batch_axis, lead_dims=model.lead_dims, fsdp_axis=model.fsdp_axis)
    self.micro_steps = MicroSteps(count=config.grad_accum_steps, batch_size=config.batch_size)
    self._gradients = StepFunction(self._gradients_fn)
    self._apply = StepFunction(self._apply_fn)
    self._evaluate = StepFunction(self._evaluate_fn)
    self._reference = StepFunction(self._reference_fn)

  def pack(self, batch):
    """The program's packed batch; with `grad_accum_steps` k, a list of k
    packed micro-steps of batch_size / k rows each."""
    return self.micro_steps.pack(batch, self.program.pack)

  def client_rows(self, batch_size: int) -> np.ndarray | None:
    return client_rows(self.mesh, batch_axis=self.program.batch_axis, batch_size=batch_size,
                       parts=self.micro_steps.count * self.program.rows_parts)

  def loss_and_metrics(self, packed, training: bool = False):
    """The program's loss and metrics in its step context, not compiled (to
    trace inside a caller's function); dropout is on inside a caller's
    `layout_core.model.random.random_context`."""
    return finish(self._sums(packed, training))

  def _sums(self, packed, training: bool = False):
    with entered(self.program.context(packed)):
      return self.program.loss_and_metrics(packed, training)

  def _gradients_fn(self, packed):
    seed = step_seed(self.config.seed, self.counters.step.read_value())
    return self.micro_steps.gradients(
        packed, lambda part, first_row: self._micro_step(part, seed=seed, first_row=first_row),
        one_at_a_time=True)

  def _micro_step(self, batch, *, seed, first_row: int):
    # The one place a training step's context is entered: around the forward
    # and the backward pass alike.
    with random_context(seed=seed, batch_offset=first_row), entered(self.program.context(batch)):
      with tf.GradientTape() as tape:
        sums = self.program.loss_and_metrics(batch, training=True)
        target = self.micro_steps.target(sums[0])
      # Dense gradients: an embedding's IndexedSlices gradient passed on to the
      # update function arrives with a wrong shape under DTensor (TF 2.21).
      grads = [tf.convert_to_tensor(g) for g in tape.gradient(target, self.trainable)]
    return sums, self.optimizer.sliced_gradients(grads)

  def _apply_fn(self, grads):
    lr, grad_norm = self.optimizer.apply(grads, self.counters.step.read_value())
    self.counters.advance()
    return lr, grad_norm

  def _evaluate_fn(self, packed):
    return self.micro_steps.evaluate(packed, self._sums)

  def _reference_fn(self, packed):
    with entered(self.program.context(packed)):
      return self.program.reference_features(packed, adapters=True)

  def reference_features(self, batch: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The task's `reference_features` of the model as it is (forward only,
    adapters on) on a host batch, as host arrays [B, ...]: a reference
    precomputed from the starting model (`layout_core.train.reference_logps`)."""
    return join_rows(self._reference(self.program.pack(batch)))

  def loss_and_gradients(self, packed):
    return self._gradients(packed)

  def apply_gradients(self, gradients):
    return self._apply(gradients)

  def evaluate(self, packed):
    return self._evaluate(packed)

  def summaries(self):
    return self.program.summaries()


def join_rows(parts: Sequence[Mapping[str, Any]]) -> dict[str, np.ndarray]:
  """Per-row features of a batch's consecutive parts as host arrays of all rows."""
  return {name: np.concatenate([to_numpy(part[name]) for part in parts])
          for name in parts[0]}


def pack_batch(batch: Mapping[str, np.ndarray], *, mesh, batch_axis: str) -> dict:
  """Each feature of a host batch on `mesh`, split over `batch_axis` along its
  first dimension (each device gets only its slice)."""
  return {name: mesh_lib.pack_global_array(
      value, dtensor.Layout([batch_axis] + [UNSHARDED] * (value.ndim - 1), mesh))
          for name, value in batch.items()}


def check_step_compiles(engine: StepEngine, task: Task, config: TrainConfig) -> None:
  """Runs forward and backward once on a real batch, updating nothing.

  Some layouts pass every rank/axis/divisibility check and still cannot be
  compiled by DTensor (it fails at the first step, deep inside TF). This
  makes that happen before training starts, as a ConfigError naming the
  sharded variables and their rules. It compiles the function the training
  steps then use, so it costs one step, not a compile."""
  reader = task.reader(split='eval', batch_size=config.batch_size,
                       rows=engine.client_rows(config.batch_size))
  packed = engine.pack(next(reader))
  try:
    loss = engine.loss_and_gradients(packed)[0]
    to_numpy(loss)  # DTensor errors are asynchronous: wait for the values
  except ConfigError:  # the task's or the model's own message
    raise
  except (tf.errors.OpError, ValueError) as e:
    raise unrunnable_layout_error(e, engine.layout_records) from None


def unrunnable_layout_error(error: Exception, records) -> ConfigError:
  """A ConfigError for a model DTensor could not run with its layouts."""
  lines = [line.strip() for line in str(error).splitlines() if line.strip()]
  reason = next((line.split('error:', 1)[1].strip() for line in lines if 'error:' in line),
                None)
  if reason is None:  # a traced function's message: its last line says what failed
    said = [line for line in lines if not line.startswith(('File ', 'in user code', '"'))]
    reason = said[-1] if said else type(error).__name__
  sharded = [r for r in records if any(a != UNSHARDED for a in r.spec)]
  if not sharded:  # nothing is sharded: the layouts cannot be the cause
    return ConfigError(f'the first training step failed: {reason}',
                       where='the model, the task and the data together',
                       fix='check that the model takes the data\'s shapes and dtypes '
                           '(run with --verbose for the traceback)')
  listing = '; '.join(f"'{r.path}' {r.spec} by rule {r.source}" for r in sharded[:8])
  more = f'; ... {len(sharded) - 8} more' if len(sharded) > 8 else ''
  return ConfigError(
      f'DTensor cannot run this model with these layouts: {reason}',
      where=f'layout_rules.rules (sharded variables: {listing or "none"}{more})',
      fix='leave the dimension DTensor names unsharded (change that rule\'s spec or '
          'narrow its regex); launch.inspect shows every variable\'s layout')
