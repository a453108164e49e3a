"""The sub-mesh engine: stages on their own devices or DTensor sub-meshes.

Any sequence of layers (heterogeneous stages) can run here. Two engines share
the clock order of `schedule.clock_order`:

* `Pipeline`: a forward pass in one function (library use, tests, bench):

      pipe = Pipeline(plan, placement=DevicePlacement(['/CPU:0', '/CPU:1']),
                      num_micro_batches=4)
      y = pipe(x)          # same values as the layers in order; fetched
                           # activations (Stage.fetch) follow: y, *fetched

* `GPipe`: loss and gradients in two functions (what pipelined training runs
  with pipeline.engine = 'submesh').

The sub-meshes of one function do run at the same time (measured with no
pipeline: `bench/devices_concurrent.py`); this engine's step is slower than
serial on CPU because of its per-micro-batch dispatch, relayouts and
recomputation (`bench/step.py`).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

from absl import logging

from layout_core.lazy import Module, tf, dtensor
from layout_core.errors import ConfigError
from layout_core.model import moe
from layout_core.model.built import StepFunction
from layout_core.model.random import random_context
from layout_core.optim import squared_norm
from layout_core.tasks.objective import (Mean, add_parts, denominator, finish,
                                         gradient_divisor, total_of)
from layout_core.pipeline import schedule as schedule_lib
from layout_core.pipeline.partitioning import PartitionPlan
from layout_core.pipeline.placement import SubMeshPlacement
from layout_core.pipeline.stages import as_tuple, num_fetched, split_fetched, stage_params
from layout_core.step_context import current, entered


class Pipeline(Module):
  """Runs partitioned stages over micro-batches in clock order (forward only).

      buffer[k] = <empty> for every stage k > 0   # `bubble_fill` (NaN in tests)
      for clock, work in enumerate(clock_order(K, M)):
        for stage k, micro-batch m in work:
          x = micro_batch[m] if k == 0 else buffer[k][m]
          y, fetched = stage_k(x)                  # on stage k's devices
          fetched activations -> output[m] (crossed to the last stage)
          if k == K - 1: output[m] = y
          else:          buffer[k + 1][m] = cross(y, k -> k + 1)

  Everything is unrolled in one tf.function: stage k on micro-batch m and
  stage k+1 on m-1 are independent ops (concurrent on plain devices).
  """

  def __init__(self, plan: PartitionPlan, *, placement, num_micro_batches: int = 1,
               batch_dim: int = 0, name: str = 'lm', bubble_fill: float | None = None,
               stages: Sequence[Callable] | None = None):
    super().__init__(name=name)
    if num_micro_batches < 1:
      raise ConfigError(f'pipeline.num_micro_batches is {num_micro_batches}',
                        fix='use at least 1')
    self.plan = plan
    self.placement = placement
    self.num_micro_batches = num_micro_batches
    self.batch_dim = batch_dim
    self.bubble_fill = bubble_fill  # NaN in tests: a schedule bug then shows
    if hasattr(placement, 'batch_dim'):
      placement.batch_dim = batch_dim
    if stages is None:
      stages = [placement.build(k, p, parent_path=name)
                for k, p in enumerate(stage_params(plan))]
    self.stages = list(stages)
    logging.info('Pipeline: %s', plan.describe())

  @property
  def num_stages(self) -> int:
    return len(self.stages)

  def bubble_fraction(self) -> float:
    return schedule_lib.bubble_fraction(self.num_stages, self.num_micro_batches)

  def split(self, x: tf.Tensor) -> list[tf.Tensor]:
    size = x.shape[self.batch_dim]
    if size % self.num_micro_batches:
      raise ConfigError(
          f'pipeline.num_micro_batches={self.num_micro_batches} does not divide the '
          f'batch of {size} (dim {self.batch_dim} of shape {x.shape.as_list()})',
          where='pipeline.num_micro_batches',
          fix=f'use a divisor of {size}, or change train.batch_size')
    if self.num_micro_batches == 1:
      return [x]
    if isinstance(self.placement, SubMeshPlacement):
      # DTensor cannot tf.split a sharded dim (nor give Split outputs a sharded
      # layout); a gather of each micro-batch's indices works, for any batch_dim.
      step = size // self.num_micro_batches
      layout = self.placement.batch_layout(0, x.shape.rank, self.batch_dim)
      return [dtensor.relayout(tf.gather(x, tf.range(m * step, (m + 1) * step),
                                         axis=self.batch_dim), layout)
              for m in range(self.num_micro_batches)]
    return tf.split(x, self.num_micro_batches, axis=self.batch_dim)

  def __call__(self, x: tf.Tensor):
    micro = self.split(x)
    num_stages, placement, last = self.num_stages, self.placement, self.num_stages - 1
    num_micro = self.num_micro_batches
    buffers = [[None] * num_micro for _ in range(num_stages)]
    if self.bubble_fill is not None:  # what an idle slot would hold: must never be read
      for k in range(1, num_stages):
        buffers[k] = [self._fill(k, micro[0].shape.as_list())] * num_micro
    outputs: list = [None] * num_micro
    fetched: list[list] = [[] for _ in range(num_micro)]
    for work in schedule_lib.clock_order(num_stages, num_micro):
      for k, item in work:
        m = item.micro
        inputs = micro[m] if k == 0 else buffers[k][m]
        y, extra = split_fetched(self.stages[k], placement.run(k, self.stages[k], inputs))
        fetched[m] += [placement.cross(f, k, last) if k != last else f for f in extra]
        if k == last:
          outputs[m] = y[0] if len(y) == 1 else y
        else:
          if len(y) != 1:
            raise ConfigError(f'pipeline stage {k} returns {len(y)} tensors; a stage '
                              'passes one activation to the next',
                              fix='return one tensor, or fetch extra ones (Stage.fetch)')
          buffers[k + 1][m] = placement.cross(y[0], k, k + 1)
    output = self._concat(outputs)
    if not fetched[0]:
      return output
    return (output,) + tuple(self._concat(list(column)) for column in zip(*fetched))

  def _concat(self, values: list) -> tf.Tensor:
    return values[0] if len(values) == 1 else tf.concat(values, axis=self.batch_dim)

  def _fill(self, k: int, micro_shape: list[int]) -> tf.Tensor:
    """`bubble_fill` shaped like stage k's input."""
    shapes = (tuple(micro_shape),)
    for stage in self.plan.stages[:k]:
      for p in stage.layers:
        shapes = p.cls.fprop_meta(p, *shapes).out_shapes
    value = tf.fill(shapes[0], tf.constant(self.bubble_fill, tf.float32))
    if isinstance(self.placement, SubMeshPlacement):
      mesh = self.placement.meshes[k]
      value = dtensor.copy_to_mesh(value, dtensor.Layout.replicated(mesh, len(shapes[0])))
      return dtensor.relayout(value, self.placement.batch_layout(k, len(shapes[0]),
                                                                 self.batch_dim))
    return self.placement.run(k, tf.identity, value)


class GPipe:
  """Loss and gradients of a staged model over micro-batches (GPipe).

      gpipe = GPipe(stages=runners, placement=placement, loss_fn=cross_entropy,
                    num_micro_batches=4)
      loss, grads, squared_norms = gpipe.loss_and_gradients(micro_inputs, micro_labels)
      # grads[k][i] belongs to gpipe.variables[k][i]

  Two tf.functions per step, each crossing meshes in one direction only:

  * forward: micro-batches flow through stages 0..K-2 in clock order; every
    stage input is kept.
  * backward, in the reverse clock order (`clock_order(..., reverse=True)`):
    the last stage runs forward + loss + backward per micro-batch; every
    other stage re-computes its forward from its kept input and
    back-propagates the gradient that crossed back from the next stage
    (re-materialisation: only stage inputs are held). Gradients accumulate
    over micro-batches (one AddN per variable), the loss's sums too (its total
    and its count of trained tokens), and the gradients are divided once by
    the count.

  `reference_fn(outputs, labels)`: what a preference loss needs of the
  reference model (the stages with their LoRA adapters off), per
  micro-batch on the last stage's mesh: `reference` runs it (forward only);
  with `reference_in_step`, every step runs it first and adds its features
  to the labels the loss reads.

  `routed_layers`: how many mixture-of-experts layers the stages hold
  (`layout_core.model.moe`). Their router terms reach the loss as in the
  one-program engine: each stage's penalty is differentiated in its own
  unit, weighted by its micro-batch's count of trained tokens (carried down
  from the last stage, which computes it first); the forward's values of
  the earlier stages' terms travel up to the last stage beside the
  activations, which adds them to the reported loss and metrics.

  `schedule='serial'` chains every unit of work on the previous one with
  control dependencies: the same numbers without any overlap (a benchmark
  reference).

  What a trace needs (the step's seeds, the first row, the previous unit's
  outputs) travels as arguments and return values: the object holds nothing
  that changes from one trace to the next.

  Why not one function with one tape: in TF 2.21 a tf.function whose backward
  crosses back to a DTensor mesh hangs whenever that gradient depends on
  activations that came from the same mesh (measured: any non-linear layer).
  """

  def __init__(self, *, stages: Sequence[Callable], placement,
               loss_fn: Callable[[tf.Tensor, tf.Tensor], tf.Tensor],
               num_micro_batches: int, schedule: str = 'gpipe',
               reference_fn: Callable[[tf.Tensor, Any], dict] | None = None,
               reference_in_step: bool = False, routed_layers: int = 0):
    if schedule not in ('gpipe', 'serial'):
      raise ConfigError(f'pipeline schedule {schedule!r}', fix="use 'gpipe' or 'serial'")
    for k, stage in enumerate(stages):
      if num_fetched(stage):
        raise ConfigError(
            f'pipeline stage {k} fetches {num_fetched(stage)} inner activation(s) '
            '(Stage.fetch); the training engine has no use for them: the loss reads '
            "the last stage's output only", where='Stage.fetch',
            fix='drop `fetch` from the stages you train, or run them with '
                'layout_core.pipeline.Pipeline, which returns fetched activations')
    self.schedule = schedule
    self.stages = list(stages)
    self.placement = placement
    self.loss_fn, self.reference_fn = loss_fn, reference_fn
    self.reference_in_step = reference_in_step
    self.num_micro_batches = num_micro_batches
    self.routed_layers = routed_layers
    self.variables = [list(stage.trainable_variables) for stage in self.stages]
    self._forward = StepFunction(self._forward_fn)
    self._backward = StepFunction(self._backward_fn)
    self._eval = StepFunction(self._eval_fn)
    self._reference = StepFunction(self._reference_fn)

  @property
  def num_stages(self) -> int:
    return len(self.stages)

  def bubble_fraction(self) -> float:
    return schedule_lib.bubble_fraction(self.num_stages, self.num_micro_batches)

  # -- one stage, one micro-batch (traced inside the step functions) -------------
  @staticmethod
  def _random(seeds, first_row, k: int, m: int, inputs) -> tuple | None:
    """(seed, first global row) for stage k on micro-batch m, or None (no
    dropout: `seeds` is None). `first_row` is micro-batch 0's global row: an
    int, or per stage a `put_changing` vector."""
    if seeds is None:
      return None
    row = first_row[k][0] if isinstance(first_row, (list, tuple)) else first_row
    return seeds[k][0], row + m * int(inputs[0].shape[0])

  def _routed_run(self, k: int, inputs, random: tuple | None = None):
    """(`_run`'s outputs, the router terms its MoE layers collected)."""
    with moe.collecting() as terms:
      return self._run(k, inputs, random), terms

  def _run(self, k: int, inputs, random: tuple | None = None) -> tuple:
    """Stage k on one micro-batch. With `random` = (step seed, first row), random
    layers (dropout) draw that micro-batch's masks, in the forward and in its
    re-computation alike."""
    if random is not None:
      with random_context(seed=random[0], batch_offset=random[1]):
        outputs = as_tuple(self.placement.run(k, self.stages[k], *inputs))
    else:
      outputs = as_tuple(self.placement.run(k, self.stages[k], *inputs))
    if k < self.num_stages - 1:
      for y in outputs:
        if not y.dtype.is_floating:
          raise ConfigError(f'pipeline stage {k} outputs a {y.dtype.name} tensor; '
                            'activations between stages must be floating point',
                            fix='move the cut (pipeline.partition) past that layer')
    return outputs

  def _cross(self, values, source: int, target: int) -> tuple:
    return tuple(self.placement.cross(v, source, target) for v in values)

  def _loss_sums(self, outputs: tuple, labels, terms=None, fed=None) -> tuple:
    """One micro-batch's (loss, {metric: value}) as sums
    (`layout_core.tasks.objective`): the micro-batches add theirs. `loss_fn`
    returns a loss, or (loss, {metric: value}). `terms`: the last stage's
    router terms, `fed` the earlier stages' ({path: values}), added."""
    result = self.loss_fn(outputs[0] if len(outputs) == 1 else outputs, labels)
    sums = result if isinstance(result, tuple) else (result, {})
    if terms is None:
      return sums
    return terms.extend(fed or {}).added_to(*sums, num_layers=self.routed_layers)

  def _chain(self, inputs, previous: list | None) -> tuple:
    """In the 'serial' schedule, makes this unit of work wait for the
    previous unit's outputs `previous` (None: it is the first)."""
    if self.schedule != 'serial' or previous is None:
      return tuple(inputs)
    with tf.control_dependencies(previous):
      return tuple(tf.identity(x) for x in inputs)

  def _unit_gradients(self, k: int, inputs, *, previous: list | None, labels=None,
                      output_grads=None, random=None, fed=None, weight=None):
    """Re-runs stage k on one micro-batch's kept input under a tape (after
    `previous` in the 'serial' schedule); returns ((loss, metric) sums
    or None, gradients of the floating inputs, of the variables, and what the
    next unit waits for). Router terms: the last stage adds the earlier
    stages' `fed` values to its sums; an earlier stage differentiates its
    own penalty times `weight` (its share of the loss: the micro-batch's
    count of trained tokens, or 1/M)."""
    inputs = self._chain(inputs, previous)
    floats = [x for x in inputs if x.dtype.is_floating]
    with tf.GradientTape() as tape:
      tape.watch(floats)
      outputs, terms = self._routed_run(k, inputs, random)
      sums = target = None
      if labels is not None:
        sums = self._loss_sums(outputs, labels, terms, fed)
        target = total_of(sums[0], self.num_micro_batches)
      elif terms.layers and weight is not None:  # this stage's share of the loss
        target = list(outputs) + [terms.penalty(self.routed_layers) * weight]
        output_grads = list(output_grads) + [tf.ones_like(target[-1])]
    grads = tape.gradient(target if target is not None else list(outputs),
                          floats + self.variables[k],
                          output_gradients=None if labels is not None else list(output_grads),
                          unconnected_gradients=tf.UnconnectedGradients.ZERO)
    done = [g for g in grads if g is not None]
    return sums, tuple(grads[:len(floats)]), grads[len(floats):], done

  # -- step functions --------------------------------------------------------------
  def _forward_fn(self, micro_inputs, seeds=None, first_row=0):
    """(stage inputs [k][m] for stages 1..K-1, in clock order (stages 0..K-2
    run); per micro-batch, the router terms of those stages' MoE layers on
    the last stage's mesh, {path: values}, for its loss and metrics)."""
    num_stages, num_micro = self.num_stages, self.num_micro_batches
    kept = [[None] * num_micro for _ in range(num_stages)]
    kept[0] = [as_tuple(x) for x in micro_inputs]
    fed: list[dict] = [{} for _ in range(num_micro)]
    previous = None
    for work in schedule_lib.clock_order(num_stages - 1, num_micro):
      for k, item in work:
        m = item.micro
        outputs, terms = self._routed_run(k, self._chain(kept[k][m], previous),
                                          self._random(seeds, first_row, k, m, kept[k][m]))
        previous = list(outputs)
        kept[k + 1][m] = self._cross(outputs, k, k + 1)
        for path, values in terms.layers.items():  # values only: each stage's own
          fed[m][path] = self._cross(tf.nest.map_structure(tf.stop_gradient, tuple(values)),
                                     k, num_stages - 1)  # unit differentiates its penalty
    return kept[1:], fed

  def _backward_fn(self, micro_inputs, kept, micro_labels, seeds=None, first_row=0,
                   divide=True, fed=None):
    """The forward's clock order reversed: stage k back-propagates micro-batch
    m while stage k-1 works on m-1, each re-computing its forward first.
    Each micro-batch differentiates its loss's total (a plain mean: its
    share, loss / M); the summed gradients of totals are divided once by the
    micro-batches' summed count (`divide`; not when the caller adds several
    passes first: gradient accumulation)."""
    num_stages, num_micro, last = self.num_stages, self.num_micro_batches, self.num_stages - 1
    inputs = [[as_tuple(x) for x in micro_inputs]] + [list(row) for row in kept]
    output_grads = [[None] * num_micro for _ in range(num_stages)]
    per_micro: list[list] = [[] for _ in range(num_stages)]
    loss_sums, previous = [], None
    weights = [None] * num_micro  # each micro-batch's share of the loss, on the last mesh
    for work in schedule_lib.clock_order(num_stages, num_micro, reverse=True):
      for k, item in work:
        m = item.micro
        weight = weights[m]  # the last stage ran m first: its count, carried down
        if k != last and self.routed_layers and not isinstance(weight, float):
          weight = self.placement.cross(weight, last, k)
        sums, input_grads, grads, previous = self._unit_gradients(
            k, inputs[k][m], previous=previous,
            labels=micro_labels[m] if k == last else None, output_grads=output_grads[k][m],
            random=self._random(seeds, first_row, k, m, inputs[k][m]),
            fed=fed[m] if fed else None, weight=weight)
        if sums is not None:
          loss_sums.append(sums)
          weights[m] = penalty_weight(sums[0], num_micro)
        per_micro[k].append(grads)
        if k > 0:
          output_grads[k - 1][m] = self._cross(input_grads, k, k - 1)
    # Accumulate over micro-batches: one AddN per variable.
    grads = [[tf.add_n([tf.convert_to_tensor(g) for g in column]) for column in zip(*rows)]
             for rows in per_micro]
    sums = add_parts(loss_sums)
    divisor = gradient_divisor(sums[0], mean=divide)
    if divisor is not None:
      grads = self.divide(grads, divisor)
    squared_norms = [squared_norm(stage) if stage else None for stage in grads]
    return sums, grads, squared_norms

  def divide(self, grads, count):
    """Each stage's gradients / the loss's `count` (at least 1), which is
    carried from the last stage's mesh to each stage's."""
    count, last = denominator(count), self.num_stages - 1
    if not isinstance(count, (int, float)):  # a tensor on the last stage's mesh
      count = [count if k == last else self.placement.cross(count, last, k)
               for k in range(self.num_stages)]
    else:
      count = [count] * self.num_stages
    return [[g / count[k] for g in stage] for k, stage in enumerate(grads)]

  def _eval_fn(self, micro_inputs, micro_labels):
    kept, fed = (self._forward_fn(micro_inputs) if self.num_stages > 1
                 else ([micro_inputs], [{}] * self.num_micro_batches))
    last = [as_tuple(x) for x in kept[-1]]
    return add_parts([self._eval_sums(last[m], micro_labels[m], fed[m])
                      for m in range(self.num_micro_batches)])

  def _eval_sums(self, inputs, labels, fed) -> tuple:
    outputs, terms = self._routed_run(self.num_stages - 1, inputs)
    return self._loss_sums(outputs, labels, terms, fed)

  def _reference_fn(self, micro_inputs, micro_labels, adapters=False):
    """Forward only, LoRA adapters off (or on: `adapters`), no dropout: each
    micro-batch's `reference_fn(outputs, labels)` on the last stage's mesh."""
    with entered(current().replace(adapters=adapters, random=None)):
      kept = self._forward_fn(micro_inputs)[0] if self.num_stages > 1 else [micro_inputs]
      last = [as_tuple(x) for x in kept[-1]]
      outputs = [self._run(self.num_stages - 1, last[m]) for m in range(self.num_micro_batches)]
    return [self.reference_fn(y[0] if len(y) == 1 else y, labels)
            for y, labels in zip(outputs, micro_labels)]

  def reference(self, micro_inputs, micro_labels, adapters: bool = False) -> list:
    """Forward only, LoRA adapters off (or on): each micro-batch's `reference_fn`."""
    self._check(micro_inputs)
    return self._reference(list(micro_inputs), list(micro_labels), adapters)

  def _with_reference(self, micro_inputs, micro_labels) -> list:
    """`micro_labels` with the reference model's features added (`reference_fn`)."""
    micro_labels = list(micro_labels)
    if not self.reference_in_step:
      return micro_labels
    return [{**labels, **reference} for labels, reference in
            zip(micro_labels, self._reference(list(micro_inputs), micro_labels))]

  # -- public --------------------------------------------------------------------------
  def loss(self, micro_inputs, micro_labels) -> tf.Tensor:
    """Forward only (evaluation): the loss of all micro-batches together."""
    return finish(self.loss_and_metrics(micro_inputs, micro_labels))[0]

  def loss_and_metrics(self, micro_inputs, micro_labels) -> tuple:
    """Forward only: the loss and each metric `loss_fn` returns, as the sums
    of all micro-batches (`layout_core.tasks.objective.finish` gives the
    numbers)."""
    self._check(micro_inputs)
    return self._eval(list(micro_inputs), self._with_reference(micro_inputs, micro_labels))

  def loss_and_gradients(self, micro_inputs, micro_labels, seeds=None):
    """(mean loss, [per-stage gradient lists], [per-stage squared gradient norm]),
    each on its stage's mesh (the loss on the last stage's). `seeds`: this
    step's random seed on each stage's mesh, for dropout, as a vector whose
    element 0 is read (`SubMeshPlacement.put_changing`)."""
    sums, grads, squared_norms = self.loss_metrics_and_gradients(
        micro_inputs, micro_labels, seeds=seeds)
    return finish(sums)[0], grads, squared_norms

  def loss_metrics_and_gradients(self, micro_inputs, micro_labels, seeds=None,
                                 first_row=0, divide=True):
    """((loss, metrics) sums, gradients, squared norms): as
    `loss_and_gradients`, with the metrics, and the loss as its sums.
    `divide` False: the gradients of the loss's total, not yet divided by
    its count (gradient accumulation adds passes first).
    `first_row`: the global row of the first micro-batch's first row (gradient
    accumulation: dropout masks of the rows, not of the call); an int, or per
    stage a `put_changing` vector (then one trace serves every micro-step)."""
    self._check(micro_inputs)
    seeds = list(seeds) if seeds is not None else None
    kept, fed = (self._forward(list(micro_inputs), seeds, first_row)
                 if self.num_stages > 1 else ([], None))
    return self._backward(list(micro_inputs), kept,
                          self._with_reference(micro_inputs, micro_labels), seeds, first_row,
                          divide, fed)

  def _check(self, micro_inputs) -> None:
    if len(micro_inputs) != self.num_micro_batches:
      raise ValueError(f'{len(micro_inputs)} micro-batches given, '
                       f'{self.num_micro_batches} expected')



def penalty_weight(loss, parts: int):
  """What a stage's router penalty is multiplied by in its unit's gradient,
  so that it enters the loss as the one-program engine adds it
  (`moe.weighted`): a `Mean` loss's count (its total is divided by the
  summed count once), a plain mean's 1 / parts."""
  return loss.count if isinstance(loss, Mean) else 1.0 / parts
