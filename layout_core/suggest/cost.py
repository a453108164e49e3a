"""Predicted step time of a planned run: compute, communication, overheads.

    profile = ModelProfile.of(params, input_shapes=[(32, 64)])   # once per model
    cost = predict_step(profile, records=plan.records, mesh_axes={'data': 2, 'model': 4},
                        config=plan.train, optimizer=plan.optimizer, pipeline=plan.pipeline,
                        rates=load_rates(device_type='CPU'))
    cost.seconds, cost.terms          # {'matmul': ..., 'tensor all-reduce': ..., ...}

What one optimizer step costs on the busiest device, from the plan alone
(`docs/choosing-a-layout.md` walks through it):

  * compute: each leaf layer's forward FLOPs (`fprop_meta`), x3 for forward
    and backward, +1 forward when it is rematerialised, split over the batch
    (data axis) and over the axes its weights are split on (tensor
    parallelism), at the calibrated matmul rate for the size of its matmuls
    and the compute dtype; its other FLOPs at the elementwise rate, those on
    the residual stream (a block's layer norms, residual adds, output bias)
    split over the batch only: every device of a tensor split repeats them;
    a routed layer's experts as executed (every slot of its [rows, E, C, D]
    buffer, not a token's k choices) split also where its experts are, its
    dispatch and combine einsums on the rows, both at the calibrated share
    of the matmul rate such batched einsums get (`moe_matmul_share`);
  * communication, each collective at the calibrated time for its kind, mesh
    axis size and message size (across hosts when the axis spans them):
    data-parallel gradient all-reduce per micro-step (with ZeRO-1 a
    reduce-scatter, half the traffic; with the SPMD engine's circular
    repeats, the cells' gradients summed per tick, `bench/spmd_repeats.py`);
    ZeRO-1's all-gather of the updated parameters per step; FSDP's
    all-gather of each weight at use (per micro-batch in a pipeline; again
    in the backward of a recomputed layer) and its gradient's reduction
    (meshgin's all-to-alls in the compute dtype where the step splits the
    batch for them, bfloat16 outside a pipeline; else DTensor's, float32,
    the gradient summed per use); tensor parallelism's all-reduce of a split
    layer's output in the forward and of its input gradient in the backward
    (two each for a Transformer block); a routed layer's token exchange
    (`bench/moe_exchange.py`): with its experts on the batch's own axis an
    all-to-all of its buffer there and one back, forward and backward; on an
    axis of their own, the combine's all-reduce and its gradient's; a
    pipeline's shift of each micro-batch's activations between stages,
    forward and backward;
  * the pipeline bubble: a stage idles for S - 1 of M + S - 1 slots
    (`PipelinePlan.bubble_fraction`) on devices of its own; where the devices
    share the host's cores (CPU) the sub-mesh engine's idle stages give their
    cores to the busy ones in part (the calibrated `shared_bubble` of it
    shows), while the SPMD engine computes every slot;
  * fixed costs, measured on real training steps of tiny models
    (`bench/calibrate.py`): per Transformer block run and device its program
    spans, per engine (x micro-batches or SPMD ticks x accumulation; x1.5
    recomputed; a pipeline's shifts included; a routed block's more), per
    tensor-parallel all-reduce, FSDP-split and ZeRO-1 variable (an FSDP
    weight per gather: again where its layer is recomputed), per variable
    the SPMD engine sums each tick, and per step; collectives add their bytes over the
    calibrated bandwidth. `bench/calibrate.py` fits each as what is left of
    its runs' measured time after this prediction of the rest.

The sum is the step time; nothing overlaps (a CPU runtime runs collectives
on the cores that compute). Plain Python.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Mapping, Sequence

from layout_core.model import moe
from layout_core.model.base import leaf_layers
from layout_core.model.layers import FeedForward, LayerNorm, TransformerBlock
from layout_core.suggest.calibration import Rates
from layout_core.suggest.facts import PlanFacts, general
from layout_core.train.config import batch_axis_for
from layout_core.train.memory import leaf_stage

UPDATE_OPS_PER_ELEMENT = 12  # an Adam update: moments, bias correction, step, clip


@dataclasses.dataclass(frozen=True)
class LeafProfile:
  """One leaf layer's forward work for the global batch."""
  path: str
  matmul_flops: float
  other_flops: float
  out_elements: float       # its output, global batch
  matmuls: int              # dense contractions in its forward
  tensor_reductions: int    # all-reduces of its output when its weights are split
  block: bool = False       # a Transformer block: the unit of the calibrated fixed cost
  stream_flops: float = 0.0  # of other_flops, on the residual stream: not split by a
                             # tensor split (layer norms, residual adds, output bias)
  expert_flops: float = 0.0  # of matmul_flops, a routed layer's experts' (as executed,
                             # every slot of its buffer): split where its experts are
  route_flops: float = 0.0   # of matmul_flops, its dispatch and combine einsums (on the rows)
  buffer_elements: float = 0.0  # a routed layer's [rows, E, C, D] buffer, global batch


@dataclasses.dataclass(frozen=True)
class ModelProfile:
  """Per-leaf work of a Params model for one global batch (computed once)."""
  leaves: tuple[LeafProfile, ...]
  batch_size: int

  @classmethod
  def of(cls, params, *, input_shapes: Sequence[tuple[int, ...]]) -> 'ModelProfile':
    shapes = tuple(tuple(s) for s in input_shapes)
    leaves = []
    for path, p in leaf_layers(params):
      meta = p.cls.fprop_meta(p, *shapes)
      block = p.cls is TransformerBlock
      stream = 0.0
      if block:  # its layer norms, two residual adds and the FFN's output bias
        stream = 3.0 * math.prod(shapes[0]) + sum(
            c.cls.fprop_meta(c, *shapes).flops for c in p.cls.child_params(p).values()
            if c.cls is LayerNorm)
      matmul, other = float(meta.matmul_flops), float(meta.flops - meta.matmul_flops)
      routed = moe.routed_child(p)
      work = routed and moe.buffer_work(routed, shapes[0])
      if work:  # the buffer as executed, for the k active experts' FLOPs
        matmul += work.expert_flops + work.route_flops - work.active_flops
        other += (work.slots - work.active_slots) * moe.slot_elementwise(routed)
      leaves.append(LeafProfile(
          path=path, matmul_flops=matmul, other_flops=other,
          out_elements=float(sum(math.prod(s) for s in meta.out_shapes)),
          matmuls=_block_matmuls(p) if block else (0 if p.cls is LayerNorm else 1),
          # a tensor split's all-reduces: a block's attention and feed-forward
          # outputs (a routed block's attention alone: the rules leave its experts'
          # inner dims whole, `plugins.suggest.planner`), or the layer's
          tensor_reductions=(1 if work else 2) if block else 1, block=block,
          stream_flops=stream,
          expert_flops=work.expert_flops if work else 0.0,
          route_flops=work.route_flops if work else 0.0,
          buffer_elements=work.buffer_elements if work else 0.0))
      shapes = meta.out_shapes
    return cls(leaves=tuple(leaves), batch_size=shapes and input_shapes[0][0])


def _block_matmuls(p) -> int:
  """A Transformer block's weight contractions: q, k, v, out, and its
  feed-forward's (2, or 3 gated; a routed one's router, its experts' and
  its shared expert's)."""
  ffn = p.cls.child_params(p)[p.cls.ffn_name(p)]
  if ffn.cls is FeedForward:
    return 4 + len(FeedForward.matrices(ffn))
  shared = ffn.cls.child_params(ffn)
  return 5 + len(ffn.cls.matrices(ffn)) + sum(len(FeedForward.matrices(c)) + 1
                                              for c in shared.values())


@dataclasses.dataclass(frozen=True)
class StepCost:
  seconds: float
  terms: dict[str, float]   # what each part adds, seconds

  def describe(self, top: int = 3) -> str:
    big = sorted(self.terms.items(), key=lambda kv: -kv[1])[:top]
    return ', '.join(f'{name} {value * 1e3:.0f} ms' for name, value in big if value > 0)


def predict_step(profile: ModelProfile, *, records, mesh_axes: Mapping[str, int], config,
                 optimizer, rates: Rates, pipeline=None, stage_axis: str = 'stage',
                 remat_of: Mapping[str, bool] | None = None, fsdp_axis: str | None = None,
                 state_axis: str | None = None, hosts: int = 1,
                 facts: PlanFacts | None = None) -> StepCost:
  """The step time of the module docstring, seconds. `facts`: the plan's
  `PlanFacts`, when the caller keeps them (else worked out from `records`)."""
  del optimizer  # its update is counted per parameter element, whatever its kind
  num_devices = math.prod(mesh_axes.values())
  batch_axis = batch_axis_for(config, mesh_axes)
  data = mesh_axes.get(batch_axis, 1)
  facts = facts or PlanFacts.of(records, profile=profile, mesh_axes=mesh_axes,
                                batch_axis=batch_axis, stage_axis=stage_axis, hosts=hosts)
  stages = mesh_axes.get(stage_axis, 1) if pipeline else 1
  accum = config.grad_accum_steps
  dtype = config.compute_dtype
  width = 2 if dtype == 'bfloat16' else 4
  scale = 1.0 / accum  # one micro-step's share of the global batch
  remat_of = remat_of or {}
  splits, spans = facts.splits, facts.spans
  terms = dict.fromkeys(('matmul', 'elementwise', 'fixed per layer', 'update',
                         'data all-reduce', 'ZeRO-1 all-gather', 'ZeRO-1 fixed',
                         'FSDP gathers', 'FSDP fixed',
                         'tensor all-reduce', 'expert exchange',
                         'pipeline shifts', 'pipeline bubble',
                         'SPMD per-tick sums'), 0.0)
  stage_of = dict(getattr(pipeline, 'layer_stages', None) or {}) if pipeline else {}
  engine = getattr(pipeline, 'engine', '')
  micro = pipeline.num_micro_batches if pipeline else 1
  repeats = pipeline.circular_repeats if pipeline else 1
  ticks = micro * repeats + stages - 1  # the SPMD engine's clock
  tensor_cross = bool(spans - {batch_axis, stage_axis})
  # Compute and tensor-parallel traffic per leaf, summed per stage (None: outside).
  parts: dict[int | None, dict[str, float]] = {}
  pipelined_blocks = 0
  for leaf in profile.leaves:
    split = splits.get(general(leaf.path), 1)
    remat = remat_of.get(leaf.path, False)
    passes = 3 + (1 if remat else 0)
    stage = leaf_stage(stage_of, leaf.path)
    runs = micro if stage is not None else 1  # once per micro-batch inside a pipeline
    key = general(leaf.path)
    routed = (leaf.expert_flops / facts.expert_splits.get(key, 1)
              + leaf.route_flops) * scale / data
    dense = (leaf.matmul_flops - leaf.expert_flops - leaf.route_flops) * scale / (data * split)
    per_call = (dense + routed) / max(leaf.matmuls, 1) / runs
    part = parts.setdefault(stage, dict.fromkeys(('matmul', 'elementwise', 'tensor',
                                                  'exchange'), 0.0))
    if dense + routed:
      part['matmul'] += passes * (dense + routed / rates.moe_matmul_share) / rates.matmul_rate(
          dtype, max(per_call, 1.0))
    if leaf.buffer_elements:
      part['exchange'] += runs * _expert_exchange(
          leaf, axis=facts.expert_axes.get(key), batch_axis=batch_axis,
          mesh_axes=mesh_axes, rates=rates, remat=remat, spans=spans,
          scale=scale / data * width / runs)
    other = (leaf.other_flops - leaf.stream_flops) / split + leaf.stream_flops
    part['elementwise'] += passes * other * scale / data / rates.elementwise_rate(dtype)
    if split > 1:
      out = leaf.out_elements * scale / data * width / runs
      calls = leaf.tensor_reductions * (2 + (1 if remat else 0)) * runs
      part['tensor'] += calls * (rates.tensor_latency(split) + rates.transfer(
          'all_reduce', split, out, cross_host=tensor_cross))
    if leaf.block:  # the fixed cost of a block run, per device its program spans
      pipelined_blocks += stage is not None
      if stage is None:
        block_runs, spanned = 1, num_devices
      elif engine == 'spmd':  # each tick runs L / (S r) stacked cells on every device
        block_runs, spanned = ticks / (stages * repeats), num_devices
      else:
        block_runs, spanned = micro, num_devices // stages
      terms['fixed per layer'] += ((rates.block_device_s[engine or 'plain']
                                    + (rates.moe_block_s if leaf.buffer_elements else 0.0))
                                   * spanned * block_runs * (1.5 if remat else 1.0))
  shared = parts.pop(None, {})
  share = _stage_share(parts, engine=engine, rates=rates, stages=stages)
  for name, term in (('matmul', 'matmul'), ('elementwise', 'elementwise'),
                     ('tensor', 'tensor all-reduce'), ('exchange', 'expert exchange')):
    terms[term] += shared.get(name, 0.0) + share * sum(p[name] for p in parts.values())
  busy = sum(shared.values()) + share * sum(sum(p.values()) for p in parts.values())
  if parts:
    stage_sums = [sum(p.values()) for p in parts.values()]
    terms['pipeline bubble'] = _bubble(stage_sums, engine=engine, pipeline=pipeline,
                                       rates=rates, stages=stages)
  compute = busy + terms['pipeline bubble']
  # Per micro-step: the data axis's gradient sums (their fixed costs are the
  # blocks' and the step's), FSDP's gathers, the pipeline's shifts.
  param_bytes = facts.param_bytes
  data_cross = batch_axis in spans
  data_scale = rates.collective_scale.get('data', 1.0)
  if fsdp_axis:
    at_use = facts.at_use_bytes
    # A weight is gathered where its layer runs: once per micro-batch inside a
    # pipeline (the SPMD engine's cells once per tick), again in the backward
    # of a recomputed layer; a weight outside both (an embedding or softmax
    # under remat = 'block', outside the stages) once per micro-step.
    runs = (ticks / (stages * repeats) if engine == 'spmd' else micro) if stage_of else 1
    recomputed = {general(path) for path, again in remat_of.items() if again}
    piped = {general(l.path) for l in profile.leaves
             if leaf_stage(stage_of, l.path) is not None}
    uses = [(runs if leaf in piped else 1, 2 if leaf in recomputed else 1, nbytes)
            for leaf, nbytes in facts.split_leaves]
    gathers = sum(r * again for r, again, _ in uses)           # variable gathers
    gathered = sum(r * again * nbytes for r, again, nbytes in uses)
    reduced = sum(r * nbytes for r, _, nbytes in uses)       # one reduction per use
    terms['FSDP fixed'] = gathers * rates.fsdp_variable_s
    if not stage_of and width < 4:
      # meshgin's all-to-alls (`fsdp.replica_axis`): the compute dtype moved,
      # the gradients summed once per step.
      terms['FSDP gathers'] = rates.collective_scale.get('fsdp', 1.0) * (
          rates.transfer('all_gather', data, gathered * width / 4, cross_host=data_cross)
          + rates.transfer('all_reduce', data, at_use, cross_host=data_cross))
    else:
      # DTensor's own collectives (float32 weights; inside a pipeline, whose
      # stages do not split the batch for FSDP): float32 gathered, and each
      # use's gradient reduced where it is made, as the data axis's sums are.
      # Both scaled by what FSDP's collectives measured in a real step (as the
      # narrow branch above is): in float32 the calibration's FSDP run took
      # less than data=8's, whose all-reduce the plain model prices.
      terms['FSDP gathers'] = rates.collective_scale.get('fsdp', 1.0) * (
          rates.transfer('all_gather', data, gathered, cross_host=data_cross)
          + data_scale * rates.transfer('all_reduce', data, reduced, cross_host=data_cross))
    unsplit = param_bytes - facts.split_bytes
  else:
    unsplit = param_bytes
  unsplit -= facts.batch_split_bytes
  if engine == 'spmd' and repeats > 1 and data > 1 and not fsdp_axis:
    # With circular repeats a cell's weights are picked per tick by slot
    # masks, past which DTensor cannot move the batch's gradient sum: each
    # tick's cell gradients are summed on their own (one all-reduce per
    # variable), not once per step with the others (`bench/spmd_repeats.py`).
    cell = facts.block_bytes * stages  # a device's row of the [S, ...] cell weights
    sums = ticks * pipelined_blocks // (stages * repeats)  # cells run per device
    unsplit -= pipelined_blocks * facts.block_bytes
    per_variable = (rates.latency('all_reduce', data) if rates.spmd_sum_variable_s is None
                    else rates.spmd_sum_variable_s)
    terms['SPMD per-tick sums'] = sums * (
        data_scale * rates.transfer('all_reduce', data, cell, cross_host=data_cross)
        + facts.block_variables * per_variable)
  state_split = mesh_axes.get(state_axis, 1) if state_axis and not fsdp_axis else 1
  # With ZeRO-1 each device sums only the slice it updates: a reduce-scatter,
  # half a ring all-reduce's traffic (`Optimizer.sliced_gradients`), scaled
  # by what ZeRO-1's collectives measured in a real step, as its all-gather.
  terms['data all-reduce'] = data_scale * rates.transfer(
      'all_reduce', data, unsplit, cross_host=data_cross) * (
          rates.collective_scale.get('zero1', 1.0) / 2 if state_split > 1 else 1.0)
  if pipeline is not None and stages > 1:
    per = _boundary_elements(profile, stage_of) * scale / data * width / micro
    cross = stage_axis in spans
    shifts = ticks if engine == 'spmd' else micro  # their fixed costs: in the blocks'
    terms['pipeline shifts'] = shifts * 2 * rates.transfer('all_gather', 2, per,
                                                           cross_host=cross)
    if engine == 'spmd':
      terms['pipeline shifts'] += ticks * rates.spmd_tick_s
  per_micro_step = (compute + terms['data all-reduce'] + terms['FSDP gathers']
                    + terms['FSDP fixed'] + terms['pipeline shifts'] + terms['fixed per layer']
                    + terms['SPMD per-tick sums'])
  for name in ('data all-reduce', 'FSDP gathers', 'FSDP fixed', 'pipeline shifts',
               'fixed per layer', 'SPMD per-tick sums',
               'matmul', 'elementwise', 'tensor all-reduce', 'expert exchange',
               'pipeline bubble'):
    terms[name] *= accum
  # Once per step: the update, ZeRO-1's gather of the new parameters, the step's own.
  elements = param_bytes / 4 / state_split
  terms['update'] = (elements * UPDATE_OPS_PER_ELEMENT / rates.elementwise_rate('float32')
                     + rates.step_s)
  if state_split > 1:
    terms['ZeRO-1 fixed'] = facts.variables * rates.zero_variable_s
    terms['ZeRO-1 all-gather'] = rates.collective_scale.get('zero1', 1.0) * rates.transfer(
        'all_gather', state_split, param_bytes, cross_host=state_axis in spans)
  seconds = (accum * per_micro_step + terms['update'] + terms['ZeRO-1 all-gather']
             + terms['ZeRO-1 fixed'])
  return StepCost(seconds=seconds, terms=terms)


def _expert_exchange(leaf: LeafProfile, *, axis, batch_axis, mesh_axes, rates: Rates,
                     remat: bool, spans, scale: float) -> float:
  """Seconds a routed leaf's tokens take to reach their experts and come
  back, per run (`bench/moe_exchange.py`): with its experts on the batch's
  own axis, an all-to-all of the buffer there and one back, forward and
  backward (twice more recomputed); on an axis of their own, one all-reduce
  of the output over it in the forward (the combine) and one of the input's
  gradient in the backward (again recomputed), as a tensor split's. `scale`
  turns the global batch's elements into bytes per device and run."""
  ways = mesh_axes.get(axis, 1) if axis else 1
  if ways <= 1:
    return 0.0
  cross = axis in spans
  if axis == batch_axis:
    calls = 4 + (2 if remat else 0)
    return calls * (rates.latency('all_to_all', ways) + rates.transfer(
        'all_to_all', ways, leaf.buffer_elements * scale, cross_host=cross))
  calls = 2 + (1 if remat else 0)
  return calls * (rates.tensor_latency(ways) + rates.transfer(
      'all_reduce', ways, leaf.out_elements * scale, cross_host=cross))


def _stage_share(parts, *, engine, rates: Rates, stages: int) -> float:
  """The share of the stages' summed work one device does per micro-step:
  its own stage's (the fullest, on devices of their own), or 1/S of all
  (the SPMD engine's stacked cells; or where the devices share the host's
  cores, which the idle stages give to the busy ones)."""
  if not parts:
    return 0.0
  sums = [sum(p.values()) for p in parts.values()]
  if engine == 'spmd' or rates.devices_share_cores:
    return 1.0 / stages
  return max(sums) / max(sum(sums), 1e-30)


def _bubble(stage_sums, *, engine, pipeline, rates: Rates, stages: int) -> float:
  """Seconds the pipeline's idle slots add per micro-step: a fraction
  `bubble_fraction` of the slots; where the sub-mesh engine's stages share the
  host's cores, the share of that the calibration measured (the idle stages'
  cores serve the busy ones, in part)."""
  fraction = pipeline.bubble_fraction()
  if engine != 'spmd' and rates.devices_share_cores:
    return rates.shared_bubble * sum(stage_sums) / stages * fraction / (1.0 - fraction)
  busy = sum(stage_sums) / stages if engine == 'spmd' else max(stage_sums)
  return busy * fraction / (1.0 - fraction)


def _boundary_elements(profile: ModelProfile, stage_of) -> float:
  """Elements of the activations that cross a stage boundary (global batch):
  the first pipelined leaf's input size, i.e. the widest residual stream."""
  inside = [l for l in profile.leaves if leaf_stage(stage_of, l.path) is not None]
  return max((l.out_elements for l in inside), default=0.0)
