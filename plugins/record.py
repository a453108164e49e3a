"""The run record: what a run writes about itself, before its first step.

    record_run(trainer, plan, model_dir='/tmp/run')

`model_dir` gets `config.gin` (the operative gin config: every value the run
used), `params.txt` (the Params tree) and `layouts.txt` (every variable's
layout), each written atomically; TensorBoard gets the same as text
(`config/gin`, `config/params`, `layouts/variables`) plus the layout scalars.
Checkpoint saves and restores become `checkpoint/*` events
(`checkpoint_event_recorder`); a resume with settings other than the
checkpoint's is said, with what it does to the learning rate
(`record_resume_changes`). Only called once the plan is valid and an
existing checkpoint is known to fit, so a rejected config changes nothing.
"""

from __future__ import annotations

import os
from typing import Callable

from absl import logging

from layout_core.checkpoint.manager import CheckpointEvent
from layout_core.train.optimizer import learning_rate
from layout_core.train.summaries import code_block
from layout_core.train.loop import Trainer
from plugins.gin_setup import gin_settings
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
  trainer.writer.text(step=0, tag='config/gin', markdown=code_block(plan.operative_config))
  trainer.writer.text(step=0, tag='config/params', markdown=code_block(params_text))
  trainer.writer.flush()
  logging.info('Operative config:\n%s', plan.operative_config)


def checkpoint_event_recorder(writer) -> Callable[[CheckpointEvent], None]:
  def record(event: CheckpointEvent) -> None:
    if event.reason in ('resume', 'init_from'):
      values = {'checkpoint/restore_seconds': event.seconds}
    else:
      values = {'checkpoint/save_seconds': event.seconds,
                'checkpoint/size_bytes': event.size_bytes}
    writer.scalars(step=event.step, values=values)
    writer.text(step=event.step, tag='checkpoint/events', markdown=event.line())
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
