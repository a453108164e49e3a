"""Memory you can predict, and model FLOPs: estimated from the plan alone.

    estimate = estimate_memory(records=plan.records, params=plan.params,
                               input_shapes=[(4, 64)], config=plan.train,
                               optimizer=plan.optimizer, mesh_axes={'data': 8})
    estimate.per_device['optimizer'], estimate.peak_per_device, estimate.host_peak

TensorFlow-free (`launch.inspect` runs it on a 100B model in seconds). The
model, per device (the fullest one) and in total (summed over the devices):

  * parameters: the layout records' `bytes_per_device` (float32 variables);
  * optimizer state: the slots the optimizer itself says it creates for each
    parameter (`slot_specs` of the class `optimizer.name` names: Adam's m and
    v; Adafactor's factored row and column statistics, or a full second
    moment, plus a first moment when `adafactor_beta1` is set), float32, each
    laid out as the parameter's dims it keeps. With `optimizer.shard_state`
    (ZeRO-1; the axis `state_axis` picks, from the same parameter count the
    optimizer uses) each slot is also split over that axis on the first dim
    the parameter leaves unsharded and the axis size divides (`add_axis`);
    other slots stay;
  * gradients: float32, laid out like their parameters (the step's gradient
    function returns all of them before the update runs);
    a frozen parameter (`lora.*`, `train.trainable`) has neither state nor
    gradient;
  * activations of one (micro-)step, `train.batch_size / grad_accum_steps`
    examples split over the batch axis, at `train.compute_dtype` (4 or 2 bytes
    an element; the logits and the loss in float32). Walked leaf by leaf
    (`leaf_layers`) from the layers' declared output shapes (`fprop_meta`);
    what each keeps for its backward pass (`kept`, outputs included):
      - TransformerBlock on x [b, t, d], h heads, ffn width f:
        8 [b, t, d] (per layer norm its centred input, normed value and output;
        the residual after attention; the block output), 4 [b, t, d] split
        with the heads (q, k, v, attention context), the probabilities
        [b, h, t, t] split with the heads, the ffn hidden [b, t, f] split with
        the ffn (2 for gelu, which also keeps its input; 3 for a gated ffn: gate,
        up and their product), + 2 [b, t, d] dropout masks when dropout is on
        (grouped-query keys and values and RMSNorm's fewer statistics are
        counted as full-width ones: an upper bound there); a routed block,
        in place of the ffn hidden, its buffers as they run (E x C slots a
        row: the dispatched input, the experts' hidden and their output, 1/n
        per device with the experts split n ways off the batch axis), its
        dispatch and combine masks [b, t, E, C] and a shared expert's hidden;
      - LayerNorm: 3 x its output; FeedForward: hidden (x2 for gelu, x3 gated) + output;
        MultiHeadAttention: 4 [b, t, d] + probabilities + output; Dropout
        (rate > 0): mask + output; Embedding: its output;
      - Softmax: the logits and the loss's saved softmax, 2 x [b, t, V] float32
        (kept whatever the remat policy: they are the loss's input);
      - any other layer: its declared outputs (a lower bound; said so).
    A tensor sharded over a model axis (heads, ffn, logits: by the layer's
    weight's spec) counts 1/n per device.
    Remat ('none' | 'block' | 'full', `train.remat`): a rematerialised layer
    keeps only its output (the next layer's input); 'block' applies to each
    TransformerBlock and each cell of a repeated Sequential, 'full' to every
    layer but the softmax. The peak adds the largest rematerialised layer's
    internals (recomputed during its backward) and a backward working set
    of one layer's kept tensors (the gradients of the layer being
    differentiated): the largest `kept` of any layer;
  * parameters count each variable in the dtype it is stored in (a frozen
    base's bfloat16 or int8 and its scales: `train.frozen_dtype`);
  * bf16 weight copies (compute_dtype 'bfloat16'): 2 bytes per trained
    parameter element per device, cast in the forward and kept for the
    backward (a frozen weight's is made again in the backward pass);
  * with `train.fsdp` (parameters, gradients and slots counted above in their
    split layouts), gathered weights instead, in the same category: each
    split weight at its rule's layout (`LayoutRecord.use_spec`) and the
    compute dtype, kept for the backward unless its leaf layer is
    recomputed, plus the largest recomputed leaf's (gathered again during
    its backward); unsplit weights' bf16 copies as above;
  * pipelined runs: each stage keeps the activations of its own layers for
    every micro-batch (GPipe), i.e. the step's batch on the stage's devices;
    layers outside the SPMD stack run on every stage. Approximate.

The peak per device is the sum of these categories (what the devices hold).
`host_peak` is the process's peak resident memory when every device lives in
it (CPU meshes), fitted by least squares to the measured peak RSS of
`launch.train` (`python bench/memory.py --fit`: 3 steps, 8 virtual CPU devices,
2-core x86, TF 2.21; 14 runs of the quickstart LM, float32 / bf16 / bf16 +
remat / bf16 + remat + sharded state, widths 128 to 1024, 2 to 8 blocks, 0.8M
to 25M parameters; every fit within 9%):

    host_peak = 573 MiB                  Python, TensorFlow, 8 devices at start
              + 53 MiB x leaf layers     the traced step functions (SPMD-expanded)
              + 1.34 x (parameters + optimizer + gradients), total
              + 1.06 x weight copies, total
              + 2.10 x activations, total

State costs a third more than its bytes (initializer and update
temporaries); activations cost about twice what the model counts, since the
backward's working set and the CPU runtime's temporaries come on top of what
is kept. Keras models: parameters, optimizer state and gradients from the
records; activations are not declared, so not known.

Model FLOPs per step (`model_flops_per_step`): 3 x the forward matmul FLOPs
the layers declare for the step's batch (`LayerMeta.matmul_flops`: the
forward, and a backward of twice the forward), rematerialisation not counted;
without declared FLOPs (Keras), 6 x parameters x tokens per step.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping, Sequence

from layout_core.model import moe
from layout_core.model.base import LayerMeta, Sequential, frozen_meta, leaf_layers
from layout_core.model.layers import (Dropout, Embedding, FeedForward, LayerNorm,
                                      MultiHeadAttention, Softmax, TransformerBlock)
from layout_core.layout import fsdp
from layout_core.layout.rules import UNSHARDED
from layout_core.layout.scope import bytes_at_use
from layout_core.layout.variables import dtype_size
from layout_core.optim.config import OptimizerConfig, state_axis
from layout_core.optim.make import optimizer_class
from layout_core.params import Params, once_per_frozen
from layout_core.train.config import batch_axis_for

MIB = 2**20
# The host-process fit of the module docstring (bench/memory.py --fit, 14 runs).
HOST_BASE_BYTES = 573 * MIB
HOST_PER_LAYER_BYTES = 53 * MIB
HOST_STATE_FACTOR = 1.34
HOST_COPIES_FACTOR = 1.06
HOST_ACTIVATION_FACTOR = 2.10
CATEGORIES = ('parameters', 'optimizer', 'gradients', 'weight copies', 'activations')


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
  """Bytes per category on the fullest device and summed over all devices."""
  num_devices: int
  per_device: dict[str, int]
  total: dict[str, int]
  activations_known: bool
  num_layers: int = 0     # leaf layers (Keras: layers with weights)
  notes: tuple[str, ...] = ()
  state_axis: str | None = None  # the mesh axis optimizer state is split over
  fsdp_axis: str | None = None   # the mesh axis parameters are split over (train.fsdp)

  @property
  def peak_per_device(self) -> int:
    return sum(self.per_device.values())

  @property
  def peak_total(self) -> int:
    return sum(self.total.values())

  @property
  def host_peak(self) -> int:
    """The whole process when every device is in its memory (CPU meshes)."""
    return self.process_peak(processes=1)

  def process_peak(self, processes: int = 1) -> int:
    """One process's peak when the devices are split evenly over `processes`
    (CPU meshes; `host_peak` is the one-process case): the fit of the module
    docstring on that process's share of the totals."""
    activations = self.total.get('activations', 0) / processes
    copies = self.total.get('weight copies', 0) / processes
    state = self.peak_total / processes - activations - copies
    return int(HOST_BASE_BYTES + HOST_PER_LAYER_BYTES * self.num_layers
               + HOST_ACTIVATION_FACTOR * activations + HOST_COPIES_FACTOR * copies
               + HOST_STATE_FACTOR * state)


def estimate_memory(*, records: Sequence[Any], params: Any,
                    input_shapes: Sequence[tuple[int, ...]], config: Any,
                    optimizer: OptimizerConfig,
                    mesh_axes: Mapping[str, int], pipeline: Any = None,
                    stage_axis: str = 'stage') -> MemoryEstimate:
  """The memory model of the module docstring. `records`: the plan's layout
  records; `params`: the Params tree (anything else: a Keras model);
  `input_shapes`: the model's input shapes for one micro-step's global batch;
  `config`/`optimizer`: TrainConfig / OptimizerConfig; `pipeline`: the
  pipeline plan, if any."""
  num_devices = math.prod(mesh_axes.values())
  stage_devices = num_devices // mesh_axes.get(stage_axis, 1) if pipeline else num_devices
  devices_of = {r.mesh: stage_devices if r.mesh else num_devices for r in records}
  batch_axis = batch_axis_for(config, mesh_axes)
  split_axis = fsdp.fsdp_axis(config.fsdp, batch_axis=batch_axis, mesh_axes=mesh_axes)
  slot_axis = state_axis(optimizer, batch_axis=batch_axis, mesh_axes=mesh_axes,
                         parameter_shapes=[r.shape for r in records], fsdp_axis=split_axis)
  known = isinstance(params, Params)
  remat_of = remat_leaves(params, config) if known else {}
  width = 2 if config.compute_dtype == 'bfloat16' else 4
  per_mesh = {name: dict(held) for name, held in
              _state_bytes(records, optimizer, mesh_axes, slot_axis).items()}
  gathered: dict[str, dict[str, int]] = {}  # mesh -> leaf -> gathered bytes (FSDP)
  for r in records:
    if r.use_spec is not None:
      leaf = _owner(r.path, remat_of)
      # The copy the math uses: the rule's split, in the compute dtype.
      nbytes = bytes_at_use(r, mesh_axes) // dtype_size(r.dtype) * width
      by_leaf = gathered.setdefault(r.mesh, {})
      by_leaf[leaf] = by_leaf.get(leaf, 0) + nbytes
    elif r.trainable and r.dtype != config.compute_dtype:
      # A frozen weight's copy is made again in the backward pass, not kept
      # (`layout_core.model.frozen.recomputed_contraction`).
      per_mesh[r.mesh]['weight copies'] += r.bytes_per_device // dtype_size(r.dtype) * width
  for name, by_leaf in gathered.items():  # kept for the backward unless recomputed
    kept = sum(n for leaf, n in by_leaf.items() if not remat_of.get(leaf, False))
    transient = max((n for leaf, n in by_leaf.items() if remat_of.get(leaf, False)), default=0)
    per_mesh[name]['weight copies'] += kept + transient
  if not per_mesh:
    per_mesh[''] = dict.fromkeys(CATEGORIES, 0)
  notes = []
  if known:
    by_stage, shared, notes = _activations(params, records, input_shapes, config, mesh_axes,
                                           pipeline, stage_axis, remat_of)
    for name, held in per_mesh.items():
      held['activations'] = shared + by_stage.get(name, 0)
  else:
    notes.append('activations: not known for a Keras model (its layers declare no '
                 'shapes); the peak leaves them out')
  fullest = max(per_mesh, key=lambda name: sum(per_mesh[name].values()))
  total = {c: sum(held[c] * devices_of.get(name, num_devices)
                  for name, held in per_mesh.items()) for c in CATEGORIES}
  keep = [c for c in CATEGORIES
          if c != 'weight copies' or config.compute_dtype == 'bfloat16' or gathered]
  layers = (len(leaf_layers(params)) if known
            else len({r.path.rsplit('/', 1)[0] for r in records}))
  return MemoryEstimate(num_devices=num_devices,
                        per_device={c: per_mesh[fullest][c] for c in keep},
                        total={c: total[c] for c in keep}, activations_known=known,
                        num_layers=layers, notes=tuple(notes), state_axis=slot_axis,
                        fsdp_axis=split_axis)


def model_flops_per_step(*, meta: LayerMeta | None, num_parameters: int,
                         tokens_per_step: int) -> float:
  """Training FLOPs of one optimizer step (see the module docstring); `meta` is
  the forward cost of the step's global batch."""
  if meta is not None:
    return 3.0 * meta.matmul_flops
  return 6.0 * num_parameters * tokens_per_step


# -- parameters, gradients, optimizer state -------------------------------------
def _state_bytes(records, optimizer, mesh_axes, slot_axis) -> dict[str, dict[str, int]]:
  """{mesh: {category: bytes per device}} of parameters, gradients and
  optimizer state (the other categories 0); once per records list and
  optimizer (the layout suggester sizes many settings of one plan)."""
  key = (id(records), optimizer, tuple(mesh_axes.items()), slot_axis)
  hit = _STATE.get(key)
  if hit is None or hit[0] is not records:
    per_mesh: dict[str, dict[str, int]] = {}
    for r in records:
      held = per_mesh.setdefault(r.mesh, dict.fromkeys(CATEGORIES, 0))
      held['parameters'] += r.bytes_per_device
      if r.trainable:  # a frozen weight (lora.*, train.trainable) has neither
        held['gradients'] += r.bytes_per_device
        held['optimizer'] += _slot_bytes(r, optimizer, mesh_axes, slot_axis)
    if len(_STATE) >= 4096:
      _STATE.clear()
    hit = _STATE[key] = (records, per_mesh)
  return hit[1]


_STATE: dict = {}  # see _state_bytes; the records list kept, so its id is not reused


# -- optimizer state ------------------------------------------------------------
def _slot_bytes(record, optimizer: OptimizerConfig, mesh_axes, slot_axis) -> int:
  """One parameter's optimizer state on one device: the slots its optimizer
  creates (`slot_specs`), each laid out as the optimizer lays it out."""
  axis_size = mesh_axes.get(slot_axis, 1) if slot_axis else 1
  total = 0
  for slot in optimizer_class(optimizer.name).slot_specs(record.shape, optimizer):
    spec = slot.layout_spec(record.spec, axis=slot_axis, axis_size=axis_size)
    shards = math.prod(mesh_axes.get(a, 1) for a in spec if a != UNSHARDED)
    total += 4 * math.prod(slot.shape) // shards
  return total


# -- activations ----------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class _Leaf:
  path: str
  kept: int        # bytes kept for the backward, outputs included (no remat)
  out: int         # bytes of its outputs
  remat: bool      # rematerialised under the run's policy
  fixed: bool = False  # the logits: kept whatever the policy


def _activations(params, records, input_shapes, config, mesh_axes, pipeline, stage_axis,
                 remat_of):
  """({stage mesh name: bytes per device}, bytes on every device, notes)."""
  splits = {r.path: (tuple(r.compute_spec), mesh_axes) for r in records}
  batch_axis = batch_axis_for(config, mesh_axes)
  batch_split = mesh_axes.get(batch_axis, 1)
  width = 2 if config.compute_dtype == 'bfloat16' else 4
  leaves, notes = [], []
  shapes = tuple(tuple(s) for s in input_shapes)
  for path, p in leaf_layers(params):
    meta = frozen_meta(p, shapes)
    leaves.append(_leaf(path, p, shapes, meta.out_shapes, splits, batch_split, width,
                        remat_of[path], notes, batch_axis=batch_axis))
    shapes = meta.out_shapes
  stage_of = dict(getattr(pipeline, 'layer_stages', None) or {}) if pipeline else {}
  engine = getattr(pipeline, 'engine', '')
  by_stage: dict[str, list[_Leaf]] = {}
  shared: list[_Leaf] = []
  for leaf in leaves:
    stage = leaf_stage(stage_of, leaf.path)
    if stage is None:
      shared.append(leaf)
    else:
      by_stage.setdefault(f'stage{stage}', []).append(leaf)
  if engine == 'submesh':  # every leaf lives on one stage's sub-mesh
    return ({name: _peak(group) for name, group in by_stage.items()}, 0, notes)
  if engine == 'spmd':  # cells stacked over the stage axis: 1/S of the stack each
    cells = [l for group in by_stage.values() for l in group]
    stages = mesh_axes.get(stage_axis, 1)
    per_stage = [dataclasses.replace(l, kept=l.kept // stages, out=l.out // stages)
                 for l in cells]
    return {'': 0}, _peak(shared + per_stage), notes
  return {}, _peak(leaves), notes


def leaf_stage(stages_by_layer: Mapping[str, int], path: str) -> int | None:
  """The pipeline stage of leaf layer `path` (or of the layer it lies in) in
  a plan's `layer_stages`; None: outside every stage."""
  if path in stages_by_layer:
    return stages_by_layer[path]
  for layer_path, stage in stages_by_layer.items():
    if path.startswith(layer_path + '/'):
      return stage
  return None


def _peak(leaves: Sequence[_Leaf]) -> int:
  """Kept tensors + the largest recomputed layer + one layer's backward working set."""
  if not leaves:
    return 0
  stored = sum(l.out if l.remat and not l.fixed else l.kept for l in leaves)
  recomputed = max((l.kept - l.out for l in leaves if l.remat and not l.fixed), default=0)
  working = max(l.kept for l in leaves)
  return stored + recomputed + working


def remat_leaves(params: Params, config) -> dict[str, bool]:
  """Leaf path -> whether the run's remat policy recomputes it."""
  repeated = _repeated_cells(params)
  return {path: config.remat == 'full' or (
              config.remat == 'block' and (p.cls is TransformerBlock or path in repeated))
          for path, p in leaf_layers(params)}


def _owner(path: str, leaves) -> str:
  """The leaf layer a variable path belongs to ('' when none does)."""
  while '/' in path:
    path = path.rsplit('/', 1)[0]
    if path in leaves:
      return path
  return ''


def _repeated_cells(params: Params) -> set[str]:
  """Leaf paths that are cells of a Sequential with repeat > 1 (once per
  frozen tree)."""
  return once_per_frozen(_REPEATED, params, id(params), lambda: _find_repeated_cells(params))


_REPEATED: dict = {}


def _find_repeated_cells(params: Params) -> set[str]:
  found: set[str] = set()

  def walk(p, parent):
    path = f'{parent}/{p.name}' if parent else p.name
    if p.cls is not Sequential:
      return
    for child in Sequential.child_params(p).values():
      if p.repeat > 1 and child.cls is not Sequential:
        found.add(f'{path}/{child.name}')
      walk(child, path)
  walk(params, '')
  return found


def _split(splits, variable: str, dim: int) -> int:
  """How many ways a tensor laid out like `variable`'s dim `dim` is split."""
  if variable not in splits:
    return 1
  spec, mesh_axes = splits[variable]
  if dim >= len(spec) or spec[dim] == UNSHARDED:
    return 1
  return mesh_axes.get(spec[dim], 1)


def _hidden_copies(kind: str, activation: str) -> int:
  """Feed-forward hidden-width tensors the backward keeps: the activation's
  input (and a gelu's output), or a gated layer's gate, up and their product."""
  if kind != 'mlp':
    return 3
  return 2 if activation.startswith('gelu') else 1


def _routed(p, path: str, x_shape, *, splits, batch_axis: str, size) -> int:
  """Elements a routed layer keeps per device (the module docstring): its
  [G, E, C, *] buffers split with the rows and, off the batch axis, with
  the experts; its [G, S, E, C] masks with the rows."""
  work = moe.buffer_work(p, x_shape)
  spec, mesh_axes = splits.get(f'{path}/{moe.MoEFeedForward.matrices(p)[0]}',
                               ((UNSHARDED,), {}))
  experts = mesh_axes.get(spec[0], 1) if spec[0] not in (UNSHARDED, batch_axis) else 1
  buffers = work.slots * (2 * p.input_dim + p.hidden_dim * _hidden_copies(p.kind, p.activation))
  masks = 2 * work.slots * x_shape[1]
  shared = sum(size(tuple(x_shape[:-1]) + (c.hidden_dim,)) * _hidden_copies(c.kind, c.activation)
               for c in p.cls.child_params(p).values())
  return size((buffers // experts + masks,)) + shared


def _leaf(path, p, in_shapes, out_shapes, splits, batch_split, width, remat, notes,
          batch_axis: str = '') -> _Leaf:
  """What one leaf layer keeps per device (see the module docstring)."""
  def size(shape):  # elements per device of a batch-major tensor
    return math.prod(shape) // batch_split

  out = sum(size(s) for s in out_shapes) * width
  cls = p.cls
  if cls is TransformerBlock:
    b, t, d = in_shapes[0]
    resid = size((b, t, d))
    heads = _split(splits, f'{path}/attn/wq', 1)
    ffn = _split(splits, f'{path}/ffn/{"w_in" if p.ffn == "mlp" else "w_up"}', 1)
    hidden = size((b, t, p.ffn_dim)) // ffn * _hidden_copies(p.ffn, p.activation)
    routed = moe.routed_child(p)
    if routed is not None:
      hidden = _routed(routed, f'{path}/moe', (b, t, d), splits=splits,
                       batch_axis=batch_axis, size=size)
    elements = (8 * resid + (4 * resid + size((b, p.num_heads, t, t))) // heads + hidden
                + (2 * resid if p.dropout_rate else 0))
    return _Leaf(path, elements * width, out, remat)
  if cls is LayerNorm:
    return _Leaf(path, 3 * out, out, remat)
  if cls is FeedForward:
    shape = tuple(in_shapes[0][:-1]) + (p.hidden_dim,)
    hidden = size(shape) // _split(splits, f'{path}/{"w_in" if p.kind == "mlp" else "w_up"}', 1)
    return _Leaf(path, _hidden_copies(p.kind, p.activation) * hidden * width + out, out, remat)
  if cls is MultiHeadAttention:
    b, t, _ = in_shapes[0]
    heads = _split(splits, f'{path}/wq', 1)
    elements = (4 * size(in_shapes[0]) + size((b, p.num_heads, t, t))) // heads
    return _Leaf(path, elements * width + out, out, remat)
  if cls is Dropout:
    return _Leaf(path, 2 * out if p.rate else 0, out if p.rate else 0, remat)
  if cls is Embedding:
    out //= _split(splits, f'{path}/table', 1)
    return _Leaf(path, out, out, remat)
  if cls is Softmax:
    logits = sum(size(s) for s in out_shapes) * 4 // _split(splits, f'{path}/w', 1)
    return _Leaf(path, 2 * logits, logits, remat, fixed=True)
  notes.append(f'activations of {path} ({cls.__name__}): its declared outputs only '
               '(a lower bound)')
  return _Leaf(path, out, out, remat)
