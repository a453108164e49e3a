"""The SPMD stage-axis engine: one program, every stage computing at once.

    stack = StackedCells(cells, parent_path='lm', mesh=mesh, rules=rules,
                         num_stages=2, repeats=2)        # weights [stages, R*c, ...]
    engine = SpmdPipeline(stack, num_micro_batches=8)
    outputs = engine(micro_inputs)                        # one [mb, ...] per micro-batch

For a stack of identical cells (the LM's repeated block), each per-cell
variable becomes one stacked variable `[S, Q, *cell_shape]` (Q = R*c cells per
stage) whose dim 0 is sharded over the mesh's stage axis and whose cell dims
follow the layout rules for the per-cell path (`lm/stack/block_003/ffn/w_in`).
Cell l (layer order) is chunk l // c; chunk n lives on stage n % S as its
repeat n // S, so with circular repeats a stage holds R non-adjacent chunks.
What the step runs (everything unrolled in one tf.function on one mesh):

    buffer = <empty> [S, mb, ...], stage-sharded      # NaN-poisoned in tests
    for clock t in 0 .. R*M + S - 2:                  # schedule.clock_order
      slot 0 <- micro-batch t (t < M), or stage S-1's output of item t - M
                (circular repeats), or nothing (bubble)
      x = where(slot holds an item, buffer, 0)        # bubbles compute on zeros
      for cell j of the chunk:                        # all S slots in one op
        x = Cell.apply(x; weights[s, q_s(t) * c + j] per slot s)
      slot S-1's result -> output (last repeat) or kept for slot 0 at t + M
      buffer = shift(x)                               # slot s -> s + 1

`Cell.apply` is the layer's own math (`layout_core.model.layers`), given the
weights as `SlotWeights` (lead 's'): this module holds no layer math.
The shift is an einsum with a [S, S] shift matrix followed by a relayout back
to stage-sharded (tf.roll and tf.concat on a sharded dim fail in DTensor,
tf.gather replicates the buffer; see shared/DTENSOR_NOTES.md). The backward
pass is the tape's reverse of the same program, so gradients accumulate over
micro-batches and repeats by construction. Dropout masks are drawn per slot
from (step seed, the cell's own layer path, the micro-batch's global rows):
exactly the masks of an unpipelined step.

Checkpoints keep per-cell keys: every stacked variable (and its optimizer
slots) is tagged with its per-cell pieces (`layout_core.layout.stacked_keys.set_unstacked`), so
`model/stack/block_003/ffn/w_in` is `stacked[s, q]` on save and restore, and
a checkpoint moves between this engine, the sub-mesh engine and plain runs.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Mapping, Sequence

import numpy as np

from layout_core.lazy import Module, tf, dtensor
from layout_core.model.activations import residual_pin
from layout_core.layout import fsdp
from layout_core.layout import mesh as mesh_lib
from layout_core.layout.stacked_keys import set_unstacked
from layout_core.errors import ConfigError
from layout_core.layout.scope import LayoutRecord, initial_dtensor
from layout_core.params import Params
from layout_core.pipeline import schedule as schedule_lib
from layout_core.pipeline.plan import (cell_slot, check_cell_count, check_identical_cells,
                                       check_stackable)
from layout_core.layout.rules import UNSHARDED, LayoutRules
from layout_core.layout.variables import StackedValues, dvariable, path_seed
from layout_core.model import frozen
from layout_core.model.remat import rematerialized
from layout_core.model.random import DropoutInputs
from layout_core.model.weights import GatheredAtUse, Split, Weights, cast, waits_for
from layout_core.step_context import StepContext, current

# The path component that stands for "every cell" in stacked variable paths:
# lm/stack/stacked_cells/ffn/w_in holds lm/stack/block_000/ffn/w_in, ...
STACKED = 'stacked_cells'


def stacked_path(stack_path: str, relative: str) -> str:
  return f'{stack_path}/{STACKED}/{relative}'


# -- the stacked variables -----------------------------------------------------
class StackedCells(Module):
  """The stack's cells as stacked DVariables `[S, Q, *cell_shape]`.

  Variables live in a module tree mirroring one cell (`stacked_cells/attn/wq`),
  so checkpoint keys are the cell's keys with `stacked_cells` standing for the
  cell name; `records` and `variables` use the stacked paths."""

  def __init__(self, cells: Sequence[Params], *, parent_path: str, mesh: dtensor.Mesh,
               rules: LayoutRules | None, num_stages: int, repeats: int = 1,
               stage_axis: str = 'stage', batch_axis: str = 'data', seed: int = 0,
               name: str = 'stack', fsdp_axis: str | None = None):
    super().__init__(name=name)
    check_identical_cells(cells, where=f'{parent_path}/{name}')
    axes = mesh_lib.mesh_axes(mesh)
    if axes.get(stage_axis) != num_stages:
      raise ConfigError(f"mesh axis '{stage_axis}' has size {axes.get(stage_axis)}, "
                        f'the pipeline has {num_stages} stages', where='mesh.shape')
    rules = rules if rules is not None else LayoutRules()
    self.path = f'{parent_path}/{name}' if parent_path else name
    self.mesh, self.stage_axis = mesh, stage_axis
    self.batch_axis = batch_axis if batch_axis in axes else UNSHARDED
    self.cell_params = [c.Copy() for c in cells]
    self.num_stages, self.repeats = num_stages, repeats
    self.cells_per_chunk = check_cell_count(len(cells), num_stages, repeats)
    self.rows = len(cells) // num_stages  # Q
    self.slots = [cell_slot(l, num_stages=num_stages, cells_per_chunk=self.cells_per_chunk)
                  for l in range(len(cells))]
    by_slot = {(s.stage, s.row): l for l, s in enumerate(self.slots)}
    # A plain holder: attributes that are dicts of variables would be tracked
    # (and checkpointed) a second time.
    self._index = _StackIndex()
    cell_axes = {a: n for a, n in axes.items() if a != stage_axis}
    specs = [c.cls.variable_specs(c, self.path) for c in cells]
    root = tf.Module(name=STACKED)
    setattr(self, STACKED, root)
    for i, template in enumerate(specs[0]):
      relative = template.path[len(f'{self.path}/{cells[0].name}/'):]
      per_cell = [s[i] for s in specs]
      resolutions = [rules.resolve(s.path, s.shape, cell_axes, follows=s.follows)
                     for s in per_cell]
      cell_spec = resolutions[0].spec
      for spec, resolution in zip(per_cell, resolutions):
        if resolution.spec != cell_spec:
          raise ConfigError(
              f"layout rules give '{spec.path}' {resolution.spec} but "
              f"'{per_cell[0].path}' {cell_spec}; stacked cells share one layout",
              where='layout_rules.rules',
              fix='write rules that treat every cell of the stack alike')
      use_spec = (stage_axis, UNSHARDED) + tuple(cell_spec)
      # FSDP splits a cell dimension (never the stage or the row dim).
      spec = tuple(fsdp.add_axis(use_spec, (num_stages, self.rows) + tuple(template.shape),
                                 fsdp_axis, axes.get(fsdp_axis, 1),
                                 skip={0, 1} | {d + 2 for d in template.unshardable}))
      layout = dtensor.Layout(list(spec), mesh)
      order = [per_cell[by_slot[(s, q)]] for s in range(num_stages) for q in range(self.rows)]
      shape = (num_stages, self.rows) + tuple(template.shape)

      # The cells' values computed once on the host, stacked, and each device
      # given only its slice (`initial_dtensor`), as for an unstacked variable.
      # A DTensor function per stacked variable, built replicated on every
      # device and then relaid out, gave the same bits and cost tracing and
      # compiling each one: a 4-layer stack of 12 variables on
      # stage=2 x data=2 x model=2 built in 3.4 CPU-s, now 1.2.
      value = initial_dtensor(StackedValues(order, seed=seed), shape=shape,
                              dtype=template.dtype, layout=layout, seed=seed)
      path = stacked_path(self.path, relative)
      variable = dvariable(value, path=path, trainable=template.trainable)
      split = spec != use_spec
      if split:
        fsdp.set_use_layout(variable, dtensor.Layout(list(use_spec), mesh))
      _attach(root, relative, variable)
      self.stacked_variables[path] = variable
      self.pieces[path] = [(c.name, (self.slots[l].stage, self.slots[l].row))
                           for l, c in enumerate(cells)]
      set_unstacked(variable, STACKED, self.pieces[path])
      nbytes = template.num_bytes * len(cells)
      self.records.append(LayoutRecord(
          path=path, shape=shape, dtype=template.dtype, spec=spec,
          source=f'{resolutions[0].source(rules)} (+ stacked on {stage_axis})'
                 + (f' (+ fsdp over {fsdp_axis})' if split else ''),
          bytes_total=nbytes,
          bytes_per_device=nbytes // math.prod(axes[a] for a in spec if a != UNSHARDED),
          use_spec=use_spec if split else None, trainable=template.trainable))
    frozen.pair_scales(self.stacked_variables)

  @property
  def records(self) -> list[LayoutRecord]:
    return self._index.records

  @property
  def stacked_variables(self) -> dict[str, tf.Variable]:
    """Stacked path (lm/stack/stacked_cells/ffn/w_in) -> variable [S, Q, ...]."""
    return self._index.variables

  @property
  def pieces(self) -> dict[str, list[tuple[str, tuple[int, int]]]]:
    """Stacked path -> [(cell name, (stage, row))] in layer order."""
    return self._index.pieces

  def tag_slots(self, slots_by_path: dict[str, Sequence[tf.Variable]]) -> None:
    """Marks optimizer slots of the stacked variables with the same per-cell pieces."""
    for path, slot_variables in slots_by_path.items():
      for variable in slot_variables:
        set_unstacked(variable, STACKED, self.pieces[path])

  def cell_variable_path(self, layer: int, relative: str) -> str:
    return f'{self.path}/{self.cell_params[layer].name}/{relative}'

  def unstacked_values(self) -> dict[str, np.ndarray]:
    """Per-cell path -> value (tests, inspection)."""
    from layout_core.layout.variables import to_numpy  # pylint: disable=g-import-not-at-top
    values = {}
    for path, variable in self.stacked_variables.items():
      whole, relative = to_numpy(variable), path.split(f'/{STACKED}/', 1)[1]
      for l, slot in enumerate(self.slots):
        values[self.cell_variable_path(l, relative)] = whole[slot.stage, slot.row]
    return values


@dataclasses.dataclass
class _StackIndex:
  """The stack's layout records, stacked variables and per-cell pieces by
  stacked path, out of tf.Module's sight (see `StackedCells.__init__`)."""
  records: list = dataclasses.field(default_factory=list)
  variables: dict = dataclasses.field(default_factory=dict)
  pieces: dict = dataclasses.field(default_factory=dict)


def _attach(root: tf.Module, relative: str, variable: tf.Variable) -> None:
  node = root
  *parents, leaf = relative.split('/')
  for part in parents:
    if not hasattr(node, part):
      setattr(node, part, tf.Module(name=part))
    node = getattr(node, part)
  setattr(node, leaf, variable)


# -- one cell on every slot at once ---------------------------------------------------
@dataclasses.dataclass
class SlotRandom:
  """Dropout inputs per slot for one clock: the step seed, and per slot the
  cell path (None for a bubble) and its micro-batch's first global row."""
  seed: tf.Tensor
  cell_paths: list[str | None]
  first_rows: list[int]


class SlotWeights(Weights):
  """The weights of the cells on every slot at once (lead 's'): `select(name)`
  gives the [S, ...] tensor of weight `name` (a path below the cell), one
  row per slot, cast to `dtype` (the cell's compute dtype). Those FSDP
  stores split (`use_layouts[name]` = (the row's use layout, its stored
  layout)) are gathered at use as a layer's are (`GatheredAtUse`: the
  cell's split weights at once, after `inputs` when recomputed); `below`
  is the layer's path below the cell; `context` the step's, with the
  cells' residual pin."""
  lead = 's'

  def __init__(self, select: Callable[[str], tf.Tensor], random: SlotRandom | None,
               below: str = '', dtype: str | None = None,
               use_layouts: Mapping[str, tuple[dtensor.Layout, dtensor.Layout]] | None = None,
               context: StepContext | None = None, inputs: tuple = (),
               at_use: GatheredAtUse | None = None, adapters=None):
    self.select, self.slot_random, self.below, self.dtype = select, random, below, dtype
    self.adapters = adapters  # the cells' LoraConfig (layout_core.model.lora), or None
    self.use_layouts = use_layouts or {}
    self.context = current() if context is None else context
    self._at_use = at_use or GatheredAtUse(
        lambda: {path: Split(select(path), stored, use, dtype)
                 for path, (use, stored) in self.use_layouts.items()},
        waits_for(inputs, self.context))

  def _path(self, name):
    return f'{self.below}/{name}' if self.below else name

  def _read(self, name):
    path = self._path(name)
    if path in self.use_layouts:
      return self._at_use.get(path)
    value = self.select(path)
    return value if self.dtype is None else cast(value, self.dtype)

  def _stored(self, name):
    return self.select(self._path(name))

  def _recomputed(self, name):  # int8 only: the slots do not say which weights are frozen
    return (self._path(name) not in self.use_layouts and self.dtype is not None
            and self.has(name + frozen.SCALE_SUFFIX))

  def has(self, name):
    try:
      self.select(self._path(name))
    except (KeyError, AttributeError):  # a mapping's, or an object's, missing name
      return False
    return True

  def child(self, name):
    return SlotWeights(self.select, self.slot_random, self._path(name), self.dtype,
                       self.use_layouts, context=self.context, at_use=self._at_use,
                       adapters=self.adapters)

  def random(self):
    """Each slot's mask from its own cell's layer path and its micro-batch's
    global rows, so the masks equal an unpipelined step's."""
    slots = self.slot_random
    if slots is None:
      return None
    keys = [path_seed(f'{cell}/{self.below}' if self.below else cell, 0) if cell else 0
            for cell in slots.cell_paths]
    return DropoutInputs(seed=slots.seed, keys=keys, first_rows=slots.first_rows)


def _row_layout(layout: dtensor.Layout | None) -> dtensor.Layout | None:
  """A stacked [S, Q, ...] layout without the Q dim."""
  if layout is None:
    return None
  return dtensor.Layout([layout.sharding_specs[0]] + list(layout.sharding_specs[2:]),
                        layout.mesh)


def _rows(variable) -> list:
  """A stacked [S, Q, ...] variable as Q tensors [S, ...], each pinned to the
  variable's layout without the Q dim. (Unpinned, DTensor lets a consumer's
  layout flow back into the Unpack, e.g. a replicated bias added to a
  model-sharded activation, and its SPMD expansion then fails on the shape.)"""
  row = _row_layout(variable.layout)
  return [dtensor.relayout(r, row) for r in tf.unstack(variable, axis=1)]


# -- the engine ----------------------------------------------------------------------
class SpmdPipeline:
  """Runs `stack`'s cells over micro-batches on the stage axis (module doc).

  `bubble_fill` (NaN in tests) is what idle slots hold; a schedule that read
  one would poison the outputs and gradients."""

  def __init__(self, stack: StackedCells, *, num_micro_batches: int,
               bubble_fill: float | None = None):
    for cell in stack.cell_params:
      check_stackable(cell)
    self.stack = stack
    self.num_micro_batches = num_micro_batches
    self.order = schedule_lib.clock_order(stack.num_stages, num_micro_batches,
                                          repeats=stack.repeats)
    self.bubble_fill = bubble_fill

  @property
  def num_stages(self) -> int:
    return self.stack.num_stages

  def bubble_fraction(self) -> float:
    return schedule_lib.bubble_fraction(self.num_stages, self.num_micro_batches,
                                        self.stack.repeats)

  def _layout(self, rank: int) -> dtensor.Layout:
    return dtensor.Layout([self.stack.stage_axis, self.stack.batch_axis]
                          + [UNSHARDED] * (rank - 2), self.stack.mesh)

  def _slot_vector(self, values, dtype) -> tf.Tensor:
    """A per-slot constant [S] as a stage-sharded DTensor."""
    return dtensor.relayout(
        dtensor.copy_to_mesh(tf.constant(values, dtype),
                             dtensor.Layout.replicated(self.stack.mesh, 1)),
        dtensor.Layout([self.stack.stage_axis], self.stack.mesh))

  def _busy_mask(self, items, rank: int) -> tf.Tensor | None:
    """[S, 1, ...] True where the slot holds an item this clock; bubble slots
    then compute on zeros, so nothing they hold (NaN in tests) reaches an
    output or a gradient (NaN * 0 would still be NaN)."""
    busy = self._slot_vector([s in items for s in range(self.num_stages)], tf.bool)
    return tf.reshape(busy, [-1] + [1] * (rank - 1))

  def _weights(self, rows_of: list[tf.Tensor], rows: list[int]) -> tf.Tensor:
    """variable[s, rows[s]] for every slot s: [S, *cell_shape], from the
    variable's rows `rows_of` (unstacked once per step, so the backward adds up
    [S, ...] row gradients; selecting per clock with tf.gather or a one-hot
    einsum on the [S, Q, ...] variable made the backward 10-25x slower than the
    forward, measured on FC-512 cells)."""
    if len(set(rows)) == 1:
      return rows_of[rows[0]]
    picked = None
    for row in sorted(set(rows)):
      mask = self._slot_vector([float(r == row) for r in rows], rows_of[row].dtype)
      letters = 'abcdefgh'[:rows_of[row].shape.rank - 1]
      part = tf.einsum(f's,s{letters}->s{letters}', mask, rows_of[row])
      picked = part if picked is None else picked + part
    return picked

  def __call__(self, micro_inputs: Sequence[tf.Tensor]) -> list[tf.Tensor]:
    """The stack on each micro-batch ([mb, ...] each, batch-sharded, replicated
    over the stage axis); returns the outputs in the same form."""
    stack, num_stages, num_micro = self.stack, self.num_stages, self.num_micro_batches
    if len(micro_inputs) != num_micro:
      raise ValueError(f'{len(micro_inputs)} micro-batches given, {num_micro} expected')
    c, last = stack.cells_per_chunk, num_stages - 1
    shape = micro_inputs[0].shape.as_list()
    micro_size = shape[0]
    rank = len(shape) + 1
    layout = self._layout(rank)
    state = current().random
    fill = 0.0 if self.bubble_fill is None else self.bubble_fill
    first = micro_inputs[0]
    poison = tf.zeros_like(first) + tf.constant(fill, first.dtype)
    ones = self._slot_vector([1.0] * num_stages, first.dtype)
    letters = 'bcdefgh'[:rank - 1]

    def over_slots(value):
      """value [mb, ...] copied into every slot [S, mb, ...], stage-sharded. (In
      TF 2.21 DTensor, tf.broadcast_to / tf.tile onto the sharded dim crash the
      process, tf.stack fails, and tf.where broadcasting [1, ...] against a
      sharded [S, ...] crashes; an einsum with a ones vector works.)"""
      return dtensor.relayout(tf.einsum(f's,{letters}->s{letters}', ones, value), layout)

    buffer = over_slots(poison)
    shift = dtensor.copy_to_mesh(tf.constant(np.eye(num_stages, k=-1), first.dtype),
                                 dtensor.Layout.replicated(stack.mesh, 2))
    is_first_slot = tf.reshape(self._slot_vector([s == 0 for s in range(num_stages)],
                                                 tf.bool), [-1] + [1] * (rank - 1))
    last_one_hot = self._slot_vector([float(s == last) for s in range(num_stages)],
                                     first.dtype)
    variables = {path.split(f'/{STACKED}/', 1)[1]: _rows(v)
                 for path, v in stack.stacked_variables.items()}
    use_layouts = {path.split(f'/{STACKED}/', 1)[1]: (_row_layout(fsdp.use_layout(v)),
                                                      _row_layout(v.layout))
                   for path, v in stack.stacked_variables.items() if fsdp.use_layout(v)}
    kept: dict[int, tf.Tensor] = {}          # item -> stage S-1 output, for repeat r+1
    outputs: list = [None] * num_micro
    cell = stack.cell_params[0]
    names, dtype = list(variables), cell.fprop_dtype or cell.dtype
    adapters = cell.tuning.lora if cell.tuning is not None else None
    pin = residual_pin(mesh=stack.mesh, batch_axis=stack.batch_axis,
                       lead_axes=(stack.stage_axis,))
    for clock, work in enumerate(self.order):
      items = {s: item for s, item in work}
      # What enters slot 0 at this clock.
      entering = clock  # item index at slot 0
      if entering < num_micro:
        inject = micro_inputs[entering]
      elif entering < stack.repeats * num_micro:
        inject = kept.pop(entering - num_micro)
      else:
        inject = poison
      buffer = dtensor.relayout(tf.where(is_first_slot, over_slots(inject), buffer), layout)
      busy = self._busy_mask(items, rank)
      x = buffer if busy is None else tf.where(busy, buffer, tf.zeros_like(buffer))
      for j in range(c):
        rows, cell_paths, first_rows = [], [], []
        for s in range(num_stages):
          item = items.get(s)
          repeat = item.repeat if item else 0
          rows.append(repeat * c + j)
          layer = (repeat * num_stages + s) * c + j
          cell_paths.append(f'{stack.path}/{stack.cell_params[layer].name}' if item else None)
          first_rows.append((item.micro if item else 0) * micro_size
                            + (state[1] if state else 0))
        random = SlotRandom(state[0], cell_paths, first_rows) if state else None
        picked = [self._weights(variables[n], rows) for n in names]

        def run_cell(x, *picked, random=random):
          by_name = dict(zip(names, picked))
          context = current().replace(residual=pin)  # a recomputation's: remat
          return cell.cls.apply(cell, SlotWeights(by_name.__getitem__, random, dtype=dtype,
                                                  use_layouts=use_layouts, context=context,
                                                  inputs=(x,), adapters=adapters), x)
        # The picked weights are inputs, not captures: a recomputed cell's
        # gradients reach only its inputs and the variables it reads itself.
        x = rematerialized(run_cell, x, *picked) if cell.remat else run_cell(x, *picked)
        x = dtensor.relayout(x, layout)
      done = items.get(last)
      if done is not None:
        out = tf.einsum(f's,s{letters}->{letters}', last_one_hot, x)
        item_index = done.repeat * num_micro + done.micro
        if done.repeat == stack.repeats - 1:
          outputs[done.micro] = out
        else:
          kept[item_index] = out
      if clock < len(self.order) - 1:
        buffer = dtensor.relayout(tf.einsum(f'us,s{letters}->u{letters}', shift, x), layout)
    return outputs
