"""Each candidate layout of a config planned, sized and timed, as launch.train would run it.

    with gin_flags.parsed_config():
      suggester = Suggester.from_plan(make_plan(), num_devices=8, hosts=1, memory_gb=4)
    result = suggester.run()              # layout_core.suggest.search.SearchResult
    suggester.bindings(result.ranked[0].candidate)

The config's own plan is the base; a candidate replaces its mesh, layout
rules, FSDP and ZeRO-1 switches, compute dtype, remat, accumulation and
pipeline, and is planned by `plugins.plan.build_plan`, the checks
`launch.train` makes, so a candidate the suggester offers is one that
launch.train accepts. Its memory is `layout_core.train.memory`'s estimate
(per process on CPU, where a process holds its devices; per device
elsewhere), its time `layout_core.suggest.cost`'s prediction. Nothing here
imports TensorFlow or touches a device.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import re

from layout_core.errors import ConfigError
from layout_core.layout.rules import UNSHARDED, LayoutRules, axis_name
from layout_core.model import moe
from layout_core.model.base import leaf_layers
from layout_core.model.layers import TransformerBlock
from layout_core.params import Params
from layout_core.suggest import calibration, cost, search, space
from layout_core.optim.config import state_axis
from layout_core.train import memory
from plugins import gin_setup
from plugins.plan import RunPlan, build_plan

GIB = 2**30
TENSOR_AXIS = 'model'
EXPERT_PATTERN = r'.*/moe/w_(gate|up|down|in|out)'  # a routed layer's expert weights
MEGATRON_FILE = 'configs/layouts/megatron.gin'


def predict_plan(plan: RunPlan, *, rates: calibration.Rates, train=None, hosts: int = 1,
                 profile: cost.ModelProfile | None = None, remat_of: dict | None = None,
                 facts: cost.PlanFacts | None = None) -> cost.StepCost:
  """The cost model's step time of `plan` as launch.train runs it (`train`
  in place of plan.train: another dtype or remat): what the suggester ranks
  candidates by, and what bench/calibrate.py fits the measured rates to, so
  the two cannot differ. `profile`, `remat_of`, `facts`: kept by a caller
  that predicts many plans of one model."""
  train = train or plan.train
  axes = plan.mesh_spec.shape
  batch_axis = train.batch_axis
  fsdp_axis = batch_axis if train.fsdp else None
  state = state_axis(plan.optimizer, batch_axis=batch_axis, mesh_axes=axes,
                     parameter_shapes=[r.shape for r in plan.records], fsdp_axis=fsdp_axis)
  if profile is None:
    profile = cost.ModelProfile.of(plan.params, input_shapes=[
        shape for shape, _ in plan.task.input_specs(plan.train.batch_size)])
  return cost.predict_step(
      profile, records=plan.records, mesh_axes=axes, config=train, optimizer=plan.optimizer,
      rates=rates, pipeline=plan.pipeline, stage_axis=plan.pipeline_config.stage_axis,
      remat_of=memory.remat_leaves(plan.params, train) if remat_of is None else remat_of,
      fsdp_axis=fsdp_axis, state_axis=state, hosts=hosts, facts=facts)


@dataclasses.dataclass
class Suggester:
  base: RunPlan
  num_devices: int
  hosts: int
  budget: search.Budget
  rates: calibration.Rates
  tensor_rules: LayoutRules | None   # None: no tensor parallelism for this model
  tensor_lines: tuple[str, ...]      # the bindings that set them ('': the config's own)
  num_experts: int = 0               # a routed model's experts per layer (0: dense)
  _plans: dict = dataclasses.field(default_factory=dict, repr=False)  # see _plan
  _records: dict = dataclasses.field(default_factory=dict, repr=False)

  @classmethod
  def from_plan(cls, base: RunPlan, *, num_devices: int | None = None, hosts: int = 1,
                memory_gb: float | None = None, calibration_file: str | None = None,
                margins: tuple[dict, float] | None = None) -> 'Suggester':
    """A suggester for `base`'s model on `num_devices` (default: its mesh's).
    `margins`: ({family: margin}, default), else bench/suggest.py's measured."""
    if not isinstance(base.params, Params):
      raise ConfigError('launch.inspect --suggest needs a Params model: it counts each '
                        "layer's FLOPs and activations, which a Keras model does not declare",
                        where='model.params',
                        fix='inspect the Keras model without --suggest, and choose its '
                            'layout by hand (docs/choosing-a-layout.md)')
    spec = base.mesh_spec
    devices = num_devices or spec.num_devices
    if hosts < 1 or devices % hosts:
      raise ConfigError(f'--hosts={hosts} does not divide --devices={devices}',
                        where='--hosts / --devices', fix='give a host count that divides '
                                                         'the device count')
    per_process = spec.device_type == 'CPU'
    limit = _budget_bytes(memory_gb, spec, devices=devices, hosts=hosts)
    rules, lines = _tensor_rules(base)
    margins, default = margins or calibration.load_margins()
    return cls(base=base, num_devices=devices, hosts=hosts,
               budget=search.Budget(limit=limit, per_process=per_process, processes=hosts,
                                    margins=margins, default_margin=default),
               rates=calibration.load_rates(device_type=spec.device_type,
                                            path=calibration_file),
               tensor_rules=rules, tensor_lines=lines, num_experts=_num_experts(base.params))

  # -- the space ---------------------------------------------------------------
  def layouts(self) -> list[space.Layout]:
    params = self.base.params
    blocks = [p for _, p in leaf_layers(params) if p.cls is TransformerBlock]
    heads = {p.num_heads for p in blocks}
    per_host = self.num_devices // self.hosts
    # A model axis (innermost: blocks of m devices) stays within a host: its
    # blocks tile each host's devices.
    sizes = [m for m in space.divisors(self.num_devices)
             if all(h % m == 0 for h in heads) and per_host % m == 0] if heads else ()
    return space.enumerate_layouts(num_devices=self.num_devices,
                                   tensor_parallel=self.tensor_rules is not None,
                                   pipelines=bool(blocks), max_stages=len(blocks),
                                   model_sizes=sizes, num_experts=self.num_experts)

  def ladders(self, layout: space.Layout):
    """The settings tried in `layout`. No gradient accumulation on CPU: there
    bench/suggest.py measured it raising the peak, not lowering it (lm_wide,
    data=4 x model=2, ZeRO-1: 2.72 GiB at 1 micro-step, 4.37 GiB at 4)."""
    blocks = sum(p.cls is TransformerBlock for _, p in leaf_layers(self.base.params))
    cpu = self.base.mesh_spec.device_type == 'CPU'
    batch_size = self.base.train.batch_size
    ladders = list(space.settings_for(layout, batch_size=batch_size, num_layers=blocks,
                                      max_accum=1 if cpu else 64))
    if not ladders:
      raise ConfigError(space.no_settings_reason(layout, batch_size=batch_size))
    return ladders

  def run(self) -> search.SearchResult:
    return search.search(layouts=self.layouts(), ladders_of=self.ladders,
                         time_of=self.time_of, memory_of=self.memory_of,
                         least_memory=self.least_memory, budget=self.budget)

  # -- one candidate -------------------------------------------------------------
  def bindings(self, candidate: space.Candidate) -> list[str]:
    return candidate.bindings(rules=self._rules_of(candidate.layout)[1],
                              reset_pipeline=self.base.pipeline is not None)

  def _rules_of(self, layout: space.Layout) -> tuple[LayoutRules, tuple[str, ...] | None]:
    """The layout's rules, and the bindings that set them (None: the
    config's own; empty: none). A routed model's rules are one for its
    experts (dim 0 over the layout's expert axis, or replicated; their inner
    dims whole), then with a model axis the tensor rules, less any that
    would decide an expert weight or name an axis the layout lacks."""
    tensor = layout.model > 1
    if not self.num_experts:
      if not tensor:
        return LayoutRules([]), ()
      return self.tensor_rules, self.tensor_lines or None
    pairs = [(EXPERT_PATTERN, (layout.expert_axis or 'unsharded', 'unsharded', 'unsharded'))]
    if tensor:
      axes = set(layout.mesh_shape) | {UNSHARDED}
      pairs += [(rule.pattern, rule.spec) for rule in self._tensor_rules_off_experts
                if {axis_name(a) for a in rule.spec} <= axes]
    return LayoutRules(pairs), (rules_binding(pairs),)

  @functools.cached_property
  def _tensor_rules_off_experts(self) -> list:
    """The tensor rules that decide no expert weight (a routed model's)."""
    experts = [r.path for r in self.base.records if re.fullmatch(EXPERT_PATTERN, r.path)]
    return [rule for rule in self.tensor_rules.rules
            if not any(re.fullmatch(rule.pattern, path) for path in experts)]

  def least_memory(self, layout: space.Layout) -> list[space.Candidate]:
    """The settings among which one needs the least memory in `layout`, one
    per pipeline schedule (micro-batches, repeats), most micro-batches first:
    bfloat16, full remat, the most accumulation. (bfloat16 halves
    activations and gathered weights, full remat keeps the least,
    accumulation splits the batch.)"""
    least = [space.Candidate(layout, ladder[-1]) for ladder in self.ladders(layout)
             if ladder[-1].compute_dtype == 'bfloat16' and ladder[-1].remat == 'full']
    return sorted(least, key=lambda c: (-c.settings.micro_batches,
                                        -c.settings.circular_repeats))

  def memory_of(self, candidate: space.Candidate) -> tuple[int, dict]:
    """(bytes against the budget, the estimate's categories per device)."""
    plan, train = self._planned(candidate)
    micro_batch = train.batch_size // train.grad_accum_steps
    estimate = memory.estimate_memory(
        records=plan.records, params=plan.params,
        input_shapes=[shape for shape, _ in plan.task.input_specs(micro_batch)],
        config=train, optimizer=plan.optimizer, mesh_axes=plan.mesh_spec.shape,
        pipeline=plan.pipeline, stage_axis=plan.pipeline_config.stage_axis)
    need = (estimate.process_peak(self.hosts) if self.budget.per_process
            else estimate.peak_per_device)
    return need, dict(estimate.per_device)

  def time_of(self, candidate: space.Candidate) -> tuple[float, dict]:
    """(predicted step seconds, the cost model's terms)."""
    plan, train = self._planned(candidate)
    step = predict_plan(plan, rates=self.rates, train=train, hosts=self.hosts,
                        profile=self._profile, remat_of=self._remat_of(train.remat),
                        facts=self._facts(candidate.layout, candidate.settings.circular_repeats))
    return step.seconds, step.terms

  def evaluate(self, candidate: space.Candidate) -> search.Evaluation:
    """Both models for one candidate."""
    seconds, terms = self.time_of(candidate)
    need, per_device = self.memory_of(candidate)
    return search.Evaluation(candidate=candidate, need=need, seconds=seconds, terms=terms,
                             memory=per_device)

  def _planned(self, candidate: space.Candidate):
    settings = candidate.settings
    plan = self._plan(candidate.layout, settings.grad_accum, settings.micro_batches,
                      settings.circular_repeats)
    return plan, dataclasses.replace(plan.train, compute_dtype=settings.compute_dtype,
                                     remat=settings.remat)

  @functools.lru_cache(maxsize=None)
  def _remat_of(self, policy: str) -> dict:
    return memory.remat_leaves(self.base.params,
                               dataclasses.replace(self.base.train, remat=policy))

  @functools.lru_cache(maxsize=None)
  def _facts(self, layout: space.Layout, repeats: int) -> cost.PlanFacts:
    plan = self._records_plan(layout, repeats)
    return cost.PlanFacts.of(plan.records, profile=self._profile,
                             mesh_axes=plan.mesh_spec.shape,
                             batch_axis='data',
                             stage_axis=plan.pipeline_config.stage_axis,
                             hosts=self.hosts)

  @functools.cached_property
  def _profile(self) -> cost.ModelProfile:
    base = self.base
    shapes = [shape for shape, _ in base.task.input_specs(base.train.batch_size)]
    return cost.ModelProfile.of(base.params, input_shapes=shapes)

  def _plan(self, layout: space.Layout, accum: int, micro: int, repeats: int) -> RunPlan:
    """The base plan with this layout (dtype and remat change no plan); its
    layout records planned once per layout and circular repeats. Planned
    once: a ConfigError is kept and raised again."""
    key = (layout, accum, micro, repeats)
    if key not in self._plans:
      try:
        first = self._records_plan(layout, repeats)
        schedule = (first.train.grad_accum_steps, first.pipeline_config.num_micro_batches)
        self._plans[key] = (first if (accum, micro) == schedule
                            else self._build(layout, accum, micro, repeats, layouts_of=first))
      except ConfigError as error:
        self._plans[key] = error
    found = self._plans[key]
    if isinstance(found, ConfigError):
      raise found
    return found

  def _records_plan(self, layout: space.Layout, repeats: int) -> RunPlan:
    key = (layout, repeats)
    if key not in self._records:
      try:
        self._records[key] = self._first_accepted(layout, repeats)
      except ConfigError as error:
        self._records[key] = error
    found = self._records[key]
    if isinstance(found, ConfigError):
      raise found
    return found

  def _first_accepted(self, layout: space.Layout, repeats: int) -> RunPlan:
    """The first plan of this layout that launch.train would accept (its
    records serve every schedule); the ConfigError of the last tried if none."""
    error = None
    for accum, micro in self._schedules(layout, repeats):
      try:
        plan = self._build(layout, accum, micro, repeats)
      except ConfigError as e:
        error = e
        continue
      return plan
    raise error or ConfigError(f'{layout.describe()}: no schedule to plan')

  def _schedules(self, layout: space.Layout, repeats: int):
    seen = []
    for ladder in self.ladders(layout):
      for s in ladder:
        if s.circular_repeats == repeats and (s.grad_accum, s.micro_batches) not in seen:
          seen.append((s.grad_accum, s.micro_batches))
    return seen

  def _build(self, layout, accum, micro, repeats, layouts_of=None) -> RunPlan:
    base = self.base
    mesh_spec = dataclasses.replace(base.mesh_spec, shape=layout.mesh_shape)
    rules = self._rules_of(layout)[0]
    train = dataclasses.replace(base.train, fsdp=layout.state == 'fsdp', grad_accum_steps=accum,
                                batch_axis='data')
    optimizer = dataclasses.replace(base.optimizer, shard_state=layout.state == 'zero1')
    pipeline = dataclasses.replace(
        base.pipeline_config, num_stages=layout.stage, engine=layout.engine or 'submesh',
        num_micro_batches=micro, micro_batch_size=0, circular_repeats=repeats,
        stage_axis='stage')
    return build_plan(mesh_spec=mesh_spec, params=base.params, rules=rules, task=base.task,
                      optimizer=optimizer, train=train, checkpoint=base.checkpoint,
                      pipeline_config=pipeline, quiet=True, layouts_of=layouts_of)

  def __hash__(self):  # the plan cache keys on the suggester too
    return id(self)


def _num_experts(params) -> int:
  """The most experts of any routed layer of the model (0: none routed)."""
  return max((p.num_experts for p in moe.routed_layers(params)), default=0)


def _budget_bytes(memory_gb: float | None, spec, *, devices: int, hosts: int) -> int:
  """The budget: --memory_gb; else mesh.device_memory_gb (per device; on CPU
  times the devices a process holds); else, on CPU, this machine's memory."""
  if memory_gb is not None:
    if memory_gb <= 0:
      raise ConfigError(f'--memory_gb={memory_gb:g}', where='--memory_gb',
                        fix='give the memory per process (CPU) or per device in GiB, > 0')
    return int(memory_gb * GIB)
  if spec.device_memory_gb is not None:
    per_process = devices // hosts if spec.device_type == 'CPU' else 1
    return int(spec.device_memory_gb * GIB * per_process)
  if spec.device_type == 'CPU':
    return _machine_memory()
  raise ConfigError(f'--suggest needs a memory budget for {spec.device_type} devices',
                    where='mesh.device_memory_gb / --memory_gb',
                    fix='set mesh.device_memory_gb (per device) or pass --memory_gb')


def _machine_memory() -> int:
  with open('/proc/meminfo') as f:
    for line in f:
      if line.startswith('MemTotal:'):
        return int(line.split()[1]) * 1024
  return 16 * GIB


def _tensor_rules(base: RunPlan) -> tuple[LayoutRules | None, tuple[str, ...]]:
  """The rules a model axis splits this model with: the config's own when
  they name the axis; else the shipped Megatron rules when they split any
  of the model's weights; else none (no tensor parallelism)."""
  if any(TENSOR_AXIS in map(axis_name, rule.spec) for rule in base.rules.rules):
    return base.rules, ()
  value = _megatron_rules()
  rules = LayoutRules(value)
  if not any(index is not None for index in rules.match_many(r.path for r in base.records)):
    return None, ()
  return rules, (rules_binding(value),)


def _megatron_rules() -> list:
  """The (pattern, spec) pairs of the shipped configs/layouts/megatron.gin."""
  with open(gin_setup.find_gin_file(MEGATRON_FILE, [])) as f:
    text = f.read()
  return ast.literal_eval(text.split('layout_rules.rules =', 1)[1].strip())


def megatron_binding() -> str:
  """The shipped Megatron rules as one binding."""
  return rules_binding(_megatron_rules())


def rules_binding(rules) -> str:
  """`layout_rules.rules = [...]` for (pattern, spec) pairs, on one line (a
  --gin_bindings value cannot include a file)."""
  items = ', '.join(f'(r{pattern!r}, {tuple(spec)!r})' for pattern, spec in rules)
  return f'layout_rules.rules = [{items}]'
