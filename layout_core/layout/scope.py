"""The layout scope: every variable created inside it is born sharded.

    rules = LayoutRules([(r'.*/ffn/w_in', ('unsharded', 'model'))])
    with LayoutScope(mesh=mesh, rules=rules, seed=0) as scope:
      model = lm_params.Instantiate()        # variables are DVariables now
    print(table_markdown(scope.records))     # what each rule did

Each variable's initial value is computed once on the host and each device
gets only its slice (`initial_dtensor`): the same bits as one DTensor
function per variable gave, without tracing and compiling one (the
quickstart's 30 variables: ~3.5 CPU-s that way, ~0.8 s this way, most of it
DTensor's per-variable handle creation; bench/startup.py). `LayoutRecord`s
keep the resolved spec, the rule that decided it and the bytes per device;
`plan_layouts` produces the same records from specs alone (no allocation) for
`launch.inspect`. With `fsdp_axis` (`train.fsdp`) each variable is stored
split over that axis too, and tagged with the rule's layout, which its math
gathers it to (`layout_core.layout.fsdp`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from typing import Iterable, Mapping, Sequence

import numpy as np

from absl import logging

from layout_core.lazy import tf, dtensor
from layout_core.layout import mesh as mesh_lib
from layout_core.errors import ConfigError
from layout_core.layout import fsdp
from layout_core.layout.rules import UNSHARDED, LayoutRules
from layout_core.layout.variables import (Initializer, VariableSpec, creator_initial_value,
                                          dvariable, path_seed, quiet_one_shot_traces,
                                          variable_creator)


@dataclasses.dataclass(frozen=True)
class LayoutRecord:
  path: str
  shape: tuple[int, ...]
  dtype: str
  spec: tuple[str, ...]
  source: str  # 'rule N: pattern' or 'default: replicated'
  bytes_total: int
  bytes_per_device: int
  mesh: str = ''  # set when variables live on several meshes (pipeline stages)
  rule_index: int | None = None  # the rule that decided the spec; None: no rule matched
  # With FSDP (`train.fsdp`): the rule's spec, which the math gathers the
  # variable to at use; `spec` is then the stored one (the rule's + the FSDP
  # axis). None: the variable is used as stored.
  use_spec: tuple[str, ...] | None = None
  trainable: bool = True  # False: frozen (no gradient, no optimizer state)

  @property
  def compute_spec(self) -> tuple[str, ...]:
    """The layout the model's math sees this variable in."""
    return self.spec if self.use_spec is None else self.use_spec


def shards_of(spec: Sequence[str], mesh_axes: Mapping[str, int]) -> int:
  return math.prod(mesh_axes[a] for a in spec if a != UNSHARDED)


def bytes_at_use(record: LayoutRecord, mesh_axes: Mapping[str, int]) -> int:
  """Bytes per device of the copy the math uses (`compute_spec`, in the
  variable's dtype): `bytes_per_device` unless FSDP stores it split, then the
  gathered copy's. `launch.inspect`'s memory table and the run record's
  mesh.json both count it here."""
  return record.bytes_total // shards_of(record.compute_spec, mesh_axes)


def plan_layouts(specs: Iterable[VariableSpec], rules: LayoutRules,
                 mesh_axes: Mapping[str, int], *,
                 fsdp_axis: str | None = None) -> list[LayoutRecord]:
  """Resolves and validates every spec's layout without creating anything
  (with `fsdp_axis`: stored split over it as well, `layout_core.layout.fsdp`)."""
  rules.check_mesh(mesh_axes)
  return [_record(spec, rules, mesh_axes, fsdp_axis) for spec in specs]


def _record(spec: VariableSpec, rules: LayoutRules, mesh_axes: Mapping[str, int],
            fsdp_axis: str | None = None) -> LayoutRecord:
  resolution = rules.resolve(spec.path, spec.shape, mesh_axes, follows=spec.follows)
  for dim, why in spec.unshardable.items():
    if resolution.spec[dim] != UNSHARDED:
      rule = rules.rules[resolution.rule_index]
      raise ConfigError(
          f"{rule.describe()} shards variable '{spec.path}' (shape {tuple(spec.shape)}) "
          f"along dimension {dim} over mesh axis '{resolution.spec[dim]}', which DTensor "
          f'cannot run: {why}', where='layout_rules.rules',
          fix=f"leave dimension {dim} of '{spec.path}' 'unsharded' (narrow the regex or "
              'change the spec)')
  stored = tuple(fsdp.add_axis(resolution.spec, spec.shape, fsdp_axis,
                                mesh_axes.get(fsdp_axis, 1), skip=spec.unshardable))
  split = stored != tuple(resolution.spec)
  return LayoutRecord(
      path=spec.path, shape=tuple(spec.shape), dtype=spec.dtype, spec=stored,
      source=resolution.source(rules) + (f' (+ fsdp over {fsdp_axis})' if split else ''),
      bytes_total=spec.num_bytes,
      bytes_per_device=spec.num_bytes // shards_of(stored, mesh_axes),
      rule_index=resolution.rule_index, use_spec=tuple(resolution.spec) if split else None,
      trainable=spec.trainable)


def report_unused_rules(rules: LayoutRules, records: Sequence[LayoutRecord]) -> None:
  """Warns about (or, with strict rules, rejects) rules that decided none of
  the variables in `records`."""
  unused = [use for use in rules.rule_uses([r.path for r in records],
                                           [r.rule_index for r in records]) if use.unused]
  if not unused:
    return
  listing = '; '.join(f'{use.rule.describe()} ({use.describe()})' for use in unused)
  if rules.strict:
    raise ConfigError(f'{len(unused)} layout rule(s) matched no variable: {listing}',
                      where='layout_rules.rules',
                      fix='fix the regex or remove the rule '
                          '(or set layout_rules.strict = False)')
  logging.warning('%d layout rule(s) matched no variable: %s', len(unused), listing)


def unsplit_axes(mesh_axes: Mapping[str, int], *, specs: Iterable[Sequence[str]],
                 used: Iterable[str | None] = ()) -> list[str]:
  """The mesh axes of size > 1 that split nothing: named by none of `specs`
  (the variables' stored layouts) and not in `used` (the axes the run splits
  something else over: the batch axis, a pipeline's stage axis). Every device
  along such an axis holds the same values and does the same work as its
  neighbours.

      unsplit_axes({'data': 2, 'model': 4}, specs=[('unsharded',)], used=['data'])
      # ['model']
  """
  named = {axis for spec in specs for axis in spec} | set(used)
  return [axis for axis, size in mesh_axes.items() if size > 1 and axis not in named]


def unsplit_axis_warning(axis: str, size: int) -> str:
  """One line saying that mesh axis `axis` (of `size` devices) splits nothing
  (`unsplit_axes`), and what would use it."""
  return (f"mesh axis '{axis}' (size {size}) splits nothing: it is not the batch axis and "
          f'no layout rule splits a variable over it, so the {size} devices along it hold '
          f"the same values and do the same work. A layout rule naming '{axis}' in its spec "
          'would split variables over it (configs/layouts/megatron.gin does for an axis '
          "named 'model'); or fold it into the batch axis.")


class LayoutScope:
  """Creates model variables as DVariables laid out by `rules` on `mesh`."""

  def __init__(self, *, mesh: dtensor.Mesh, rules: LayoutRules | None = None,
               seed: int = 0, log_assignments: bool = False, fsdp_axis: str | None = None,
               zero_init: bool = False):
    self.mesh = mesh
    # Every variable starts as zeros, not its initializer's values: for a
    # caller that assigns each one right after (plugins.hf's import), which
    # then skips values it would throw away (the hash-based initializers took
    # 73 s of a 253M-parameter model's 87 s import).
    self.zero_init = zero_init
    self.fsdp_axis = fsdp_axis  # store variables split over it too (layout_core.layout.fsdp)
    self.rules = rules if rules is not None else LayoutRules()
    self.mesh_axes = mesh_lib.mesh_axes(mesh)
    self.rules.check_mesh(self.mesh_axes)
    self.seed = seed
    self.log_assignments = log_assignments
    self.records: list[LayoutRecord] = []
    self.variables: dict[str, dtensor.DVariable] = {}  # path -> variable, creation order
    self._context = None

  def layout(self, spec: Sequence[str]) -> dtensor.Layout:
    return dtensor.Layout(list(spec), self.mesh)

  def create(self, spec: VariableSpec) -> dtensor.DVariable:
    record = _record(spec, self.rules, self.mesh_axes, self.fsdp_axis)  # mesh checked
    if self.zero_init:
      value = mesh_lib.pack_global_array(
          np.zeros(spec.shape, tf.as_dtype(spec.dtype).as_numpy_dtype), self.layout(record.spec))
    else:
      value = initial_dtensor(spec.initializer, shape=spec.shape, dtype=spec.dtype,
                              layout=self.layout(record.spec),
                              seed=path_seed(spec.seed_path or spec.path, self.seed))
    variable = dvariable(value, path=spec.path, trainable=spec.trainable)
    if record.use_spec is not None:
      fsdp.set_use_layout(variable, self.layout(record.use_spec))
    if spec.path in self.variables:
      raise ConfigError(f"two variables share the path '{spec.path}'",
                        fix='give sibling layers distinct names')
    self.records.append(record)
    self.variables[spec.path] = variable
    if self.log_assignments:
      logging.info('layout %-48s %-22s %s', spec.path, record.spec, record.source)
    return variable

  def replicate_plain_variable(self, next_creator, **kwargs):
    """Any other tf.Variable made in the scope (RNG state, counters): replicated."""
    del next_creator
    value = creator_initial_value(kwargs)
    layout = dtensor.Layout.replicated(self.mesh, rank=value.shape.rank)
    return dtensor.DVariable(dtensor.copy_to_mesh(value, layout),
                             trainable=kwargs.get('trainable', True) is not False,
                             name=kwargs.get('name'))

  def __enter__(self) -> 'LayoutScope':
    self._context = contextlib.ExitStack()
    self._context.enter_context(quiet_one_shot_traces())
    self._context.enter_context(variable_creator(self.create))
    self._context.enter_context(tf.variable_creator_scope(self.replicate_plain_variable))
    return self

  def __exit__(self, *exc) -> None:
    self._context.close()
    self._context = None


def initial_dtensor(initializer: Initializer, *, shape: Sequence[int], dtype,
                    layout: dtensor.Layout, seed: int) -> tf.Tensor:
  """`initializer`'s value of a tensor of `shape` as a DTensor laid out as
  `layout` (`seed` is the variable's own, `path_seed`).

  The whole value is computed once, eagerly on the host CPU, and each of this
  client's devices gets its slice (`pack_global_array`). That is bit for bit
  what one DTensor function per tensor gave (it computed the whole tensor on
  every device and sliced it: a shard computed on its own can differ in the
  last bit where vectorised and scalar log/cos differ), without tracing and
  compiling a function per tensor. Inside a traced function the value is
  made under the layout instead."""
  shape, dtype = tuple(shape), tf.as_dtype(dtype)
  if not tf.executing_eagerly():
    make = tf.function(lambda: initializer(shape, dtype, seed), autograph=False)
    return dtensor.call_with_layout(make, layout)
  with tf.device('CPU:0'):
    whole = initializer(shape, dtype, seed).numpy()
  return mesh_lib.pack_global_array(whole, layout)


def bytes_per_device(records) -> int:
  """Parameter bytes on the fullest device. DTensor shards evenly, so within a
  mesh all devices hold the same; with pipeline stages, the largest stage."""
  per_mesh: dict[str, int] = {}
  for r in records:
    per_mesh[r.mesh] = per_mesh.get(r.mesh, 0) + r.bytes_per_device
  return max(per_mesh.values(), default=0)


def table_markdown(records: Sequence[LayoutRecord]) -> str:
  """The per-variable layout table (TensorBoard text / layouts.txt, and
  `launch.inspect`'s): `sharding` and `bytes/device` are where the bytes live
  (the stored layout); with FSDP a `sharding at use` column gives the layout
  the math gathers each split variable to ('-': used as stored); a mesh
  column when the variables live on several meshes (pipeline stages)."""
  with_use = any(r.use_spec is not None for r in records)
  with_mesh = any(r.mesh for r in records)
  use_head, use_rule = (' sharding at use |', '---|') if with_use else ('', '')
  mesh_head, mesh_rule = (' mesh |', '---|') if with_mesh else ('', '')
  lines = [f'| path | shape | dtype | sharding |{use_head} rule | bytes/device |{mesh_head}',
           f'|---|---|---|---|{use_rule}---|---|{mesh_rule}']
  for r in records:
    shape = 'x'.join(str(d) for d in r.shape) or 'scalar'
    use = f' {_spec_text(r.use_spec)} |' if with_use else ''
    mesh = f' {r.mesh} |' if with_mesh else ''
    source = r.source.replace('|', '\\|')  # a rule's alternation, in a table cell
    lines.append(f'| {r.path} | {shape} | {r.dtype} | {_spec_text(r.spec)} |{use} '
                 f'{source} | {r.bytes_per_device:,} |{mesh}')
  return '\n'.join(lines) + '\n'


def _spec_text(spec: Sequence[str] | None) -> str:
  return ', '.join(spec or ()) or '-'
