"""The run record: what a run writes about itself, before its first step.

    record_run(trainer, plan, model_dir='/tmp/run')

`model_dir` gets `config.gin` (the operative gin config: every value the run
used), `params.txt` (the Params tree), `layouts.txt` (every variable's
layout) and `mesh.json` (where every slice lives, for TensorBoard's Mesh tab:
`mesh_document`), each written atomically, and for a run started with
`checkpoint.init_from` its base run's tokenizer/ and hf_import.json
(`plugins.origin.carry_origin`); TensorBoard gets the same as text
(`config/gin`, `config/params`, `layouts/variables`) plus the layout scalars.
Checkpoint saves and restores become `checkpoint/saves` and
`checkpoint/restores` lines and `usage/checkpoint_*` scalars
(`checkpoint_event_recorder`); a resume with settings other than the
checkpoint's is said, with what it does to the learning rate
(`record_resume_changes`). Only called once the plan is valid and an
existing checkpoint is known to fit, so a rejected config changes nothing.
"""

from __future__ import annotations

import json
import math
import os
from typing import Callable

from absl import logging

from layout_core.checkpoint.manager import CheckpointEvent
from layout_core.layout import device_map
from layout_core.layout import mesh as mesh_lib
from layout_core.layout import scope as layout_scope
from layout_core.optim import learning_rate
from layout_core.train.summaries import code_block
from layout_core.train.loop import Trainer
from plugins.gin_setup import gin_settings
from plugins.mesh_tab import MESH_JSON, MESH_JSON_FORMAT
from plugins.origin import carry_origin
from plugins.plan import RunPlan


def write_text(model_dir: str, name: str, text: str) -> str:
  """Writes model_dir/name atomically (temp file + rename)."""
  path = os.path.join(model_dir, name)
  temporary = path + '.tmp'
  with open(temporary, 'w') as f:
    f.write(text)
  os.replace(temporary, path)
  return path


def record_run(trainer: Trainer, plan: RunPlan, *, model_dir: str) -> None:
  params_text = trainer.engine.description
  write_text(model_dir, 'config.gin', plan.operative_config)
  write_text(model_dir, 'params.txt', params_text)
  write_text(model_dir, 'layouts.txt', trainer.write_layouts())
  carry_origin(plan.checkpoint.init_from, model_dir)
  try:  # a report: it must never stop the run it reports on
    write_text(model_dir, MESH_JSON, json.dumps(mesh_document(trainer, plan),
                                                separators=(',', ':')))
  except Exception as e:  # pylint: disable=broad-except
    logging.warning('Could not write %s: %s: %s', MESH_JSON, type(e).__name__, e)
  trainer.writer.text(step=0, tag='config/gin', markdown=code_block(plan.operative_config))
  trainer.writer.text(step=0, tag='config/params', markdown=code_block(params_text))
  trainer.writer.flush()
  logging.info('Operative config:\n%s', plan.operative_config)


def mesh_document(trainer: Trainer, plan: RunPlan) -> dict:
  """mesh.json: the mesh and its devices (id, coordinates, client, pipeline
  stage, parameter and optimizer-state bytes held), the layout rules in order
  (variables decided, unused, shadowed), and every variable with its layout
  and the slices each device holds, all read from the built variables'
  DTensor layouts (`layout_core.layout.device_map`): with `train.fsdp` the
  split they are stored in, and as `use_spec` (None: used as stored) the
  layout the math gathers them to, with its bytes per device."""
  engine = trainer.engine
  mesh = engine.mesh
  stage_axis = plan.pipeline_config.stage_axis if plan.pipeline is not None else None
  placement = getattr(engine, 'placement', None)  # the sub-mesh engine's stages
  devices = device_map.mesh_devices(mesh, stage_axis=stage_axis,
                                    stage_meshes=getattr(placement, 'meshes', None))
  held = {d['id']: {'parameters': 0, 'optimizer': 0} for d in devices}
  optimizer = engine.optimizer
  trained = set(optimizer.paths)
  variables = []
  for record in engine.layout_records:
    variable = engine.variables[record.path]
    slices = device_map.variable_slices(variable, mesh=mesh)
    by_device = device_map.bytes_by_device(slices, itemsize=variable.dtype.size)
    for device_id, size in by_device.items():
      held[device_id]['parameters'] += size
    state = []
    for slot in optimizer.slots_for(record.path) if record.path in trained else []:
      slot_bytes = device_map.bytes_by_device(device_map.variable_slices(slot, mesh=mesh),
                                              itemsize=slot.dtype.size)
      for device_id, size in slot_bytes.items():
        held[device_id]['optimizer'] += size
      state.append({'shape': slot.shape.as_list(), 'spec': list(slot.layout.sharding_specs),
                    'bytes_per_device': max(slot_bytes.values())})
    # Where the bytes live: the variable's own layout, not the record's word
    # for it; with FSDP also the layout its math gathers it to (the record's
    # `use_spec`, as `launch.inspect` reports it).
    use_spec = None if record.use_spec is None else list(record.use_spec)
    variables.append({
        'path': record.path, 'shape': list(record.shape), 'dtype': record.dtype,
        'spec': list(variable.layout.sharding_specs), 'use_spec': use_spec,
        'mesh': record.mesh, 'rule_index': record.rule_index,
        'source': record.source, 'bytes_total': record.bytes_total,
        'bytes_per_device': max(by_device.values()),
        'bytes_per_device_at_use': None if use_spec is None else layout_scope.bytes_at_use(
            record, mesh_lib.mesh_axes(variable.layout.mesh)),
        'optimizer_state': state,
        'slices': [{'index': [list(r) for r in s.index], 'devices': list(s.devices)}
                   for s in slices]})
  for device in devices:
    device['bytes'] = held[device['id']]
  fullest = max(devices, key=lambda d: sum(d['bytes'].values()))
  uses = plan.rules.rule_uses([r.path for r in engine.layout_records],
                              [r.rule_index for r in engine.layout_records])
  return {
      'format': MESH_JSON_FORMAT,
      'mesh': {'axes': [[name, size] for name, size in plan.mesh_spec.shape.items()],
               'device_type': plan.mesh_spec.device_type,
               'num_devices': plan.mesh_spec.num_devices,
               'num_clients': devices[-1]['client'] + 1, 'stage_axis': stage_axis},
      'optimizer': getattr(plan.optimizer, 'name', 'adam'),
      'devices': devices, 'fullest_device': fullest['id'],
      'rules': [{'index': u.rule.index, 'pattern': u.rule.pattern, 'spec': list(u.rule.spec),
                 'matched': u.matched, 'unused': u.unused, 'shadowed': u.shadowed,
                 'fits': u.fits, 'shadowed_by': list(u.shadowed_by), 'note': u.describe()}
                for u in uses],
      'replicated_by_default': sum(r.rule_index is None for r in engine.layout_records),
      'variables': variables}


def two_significant_digits(value: float) -> float:
  """`value` rounded to 2 significant digits: TensorBoard labels axis ticks
  with 3-4, so a series that varies by a few bytes no longer draws a row of
  identical labels."""
  if value <= 0:
    return 0.0
  return round(value, 1 - math.floor(math.log10(value)))


def checkpoint_event_recorder(writer) -> Callable[[CheckpointEvent], None]:
  """Saves and restores as lines under separate tags (a resume restores at
  the step of the last save; under one tag TensorBoard keeps one line per
  step) and as `usage/checkpoint_*` scalars."""
  def record(event: CheckpointEvent) -> None:
    if event.reason in ('resume', 'init_from'):
      values = {'usage/checkpoint_restore_seconds': event.seconds}
      tag = 'checkpoint/restores'
    else:
      values = {'usage/checkpoint_save_seconds': event.seconds,
                'usage/checkpoint_size_mib': two_significant_digits(event.size_bytes / 2**20)}
      tag = 'checkpoint/saves'
    writer.scalars(step=event.step, values=values)
    writer.text(step=event.step, tag=tag, markdown=event.line())
    writer.flush()
  return record


def record_resume_changes(plan: RunPlan, *, writer, checkpoint_dir: str,
                          step: int) -> list[str]:
  """Logs and writes to TensorBoard (`resume/changed_settings`, at `step`)
  every setting that differs from the restored checkpoint's own config.gin;
  a changed `train.num_steps` also says what the learning-rate schedule,
  which spans num_steps, gives at this step now and gave before. Returns the
  lines (none when nothing changed or the checkpoint has no config)."""
  try:
    with open(os.path.join(checkpoint_dir, 'config.gin')) as f:
      before = gin_settings(f.read())
  except OSError:
    return []
  now = gin_settings(plan.operative_config)
  changed = [name for name in dict.fromkeys([*before, *now]) if before.get(name) != now.get(name)]
  if not changed:
    return []
  lines = [f'{name}: {before.get(name, "(not set)")} -> {now.get(name, "(not set)")}'
           for name in changed]
  if 'train.num_steps' in changed and before.get('train.num_steps', '').isdigit():
    old_total, new_total = int(before['train.num_steps']), plan.train.num_steps
    rate = lambda total: float(learning_rate(plan.optimizer, step, total))  # noqa: E731
    lines.append(f'the learning-rate schedule now spans {new_total} steps (was {old_total}): '
                 f'at step {step} the rate is {rate(new_total):.3e} '
                 f'({rate(old_total):.3e} under the old schedule)')
  logging.warning('Resumed at step %d with settings that differ from %s:\n  %s', step,
                  os.path.join(checkpoint_dir, 'config.gin'), '\n  '.join(lines))
  writer.text(step=step, tag='resume/changed_settings',
              markdown='\n'.join(f'* `{line}`' for line in lines))
  writer.flush()
  return lines
