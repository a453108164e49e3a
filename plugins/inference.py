"""A trained run's model on a mesh, restored read-only from its checkpoint.

    from plugins.inference import load_trained, run_config

    # launch.eval, launch.decode and launch.export parse the run's config first:
    with gin_setup.parsed_config(files=[run_config(model_dir='/tmp/run')], bindings=[]):
      plan = make_plan()
    trained = load_trained(plan, model_dir='/tmp/run')   # or checkpoint='.../ckpt-300'
    trained.step, trained.checkpoint        # 300, '/tmp/run/checkpoints/ckpt-300/ckpt'
    trained.trainer.evaluate()              # the training loop's evaluation
    logits = trained.model.call((tokens,), False)   # a BuiltModel (unpipelined engines)

The API (imported by `launch.eval`, `launch.decode`, `launch.export`, `plugins.lm_eval`):

    load_trained(plan: RunPlan, *, model_dir: str | None = None,
                 checkpoint: str | None = None, pipelined: bool = True) -> Trained
    load_decoder(*, files, bindings=(), search_paths=(), model_dir=None,
                 checkpoint=None, spm_model=None, check=None) -> Decoder
                 # plan, layers, tokenizer, trained, lm (a CachedLM): decode and lm-eval
    find_checkpoint(*, model_dir: str | None = None,
                    checkpoint: str | None = None) -> tuple[int | None, str]
    run_config(*, model_dir: str | None = None, checkpoint: str | None = None) -> str
    Trained(trainer, mesh, step, checkpoint, plan)  # frozen; .engine, .model, .variables

The model is built exactly as training builds it (`plugins.training.build_trainer`:
the mesh, the step engine the plan asks for, every variable laid out by the
plan's rules), so the config may name another mesh or other layout rules
than the run's: the checkpoint is read slice by slice into whatever layout
the model has now, as a resume reads it (docs/checkpoints.md, "Reshard").
Only the model and the step counters are read; the optimizer's state is not
needed, so a checkpoint of another optimizer loads too.

Read-only: nothing is created, moved or written under `model_dir` (no lock,
no run record, no directory preparation, no state-file repair, no
checkpoint). A damaged checkpoint is skipped with a warning when it came
from `model_dir` (the previous one is used) and refused when named, never
moved aside: that is the training run's business.

A pipelined run's checkpoint has the unpipelined model's keys
(`layout_core.layout.stacked_keys`), so it loads both into the pipelined
model its config builds (`pipelined=True`: GPipe stages on sub-meshes, or
the SPMD stage axis, evaluated by that engine) and into the same model
without the pipeline (`pipelined=False`: one program on the whole mesh, the
stage axis replicated), which is the one `Trained.model` can call directly.

Errors a user can fix are ConfigErrors (exit 2 in the launchers): no
checkpoint in `model_dir`, a `checkpoint` that does not exist or is damaged,
a checkpoint of another model (the variables that differ are listed), a
fine-tuned run's base checkpoint that moved or changed (its frozen weights
are read from there: `layout_core.checkpoint.frozen_base`;
`checkpoint.moved_base` says where it went).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable, Sequence

from absl import logging

from layout_core.checkpoint import shard_io
from layout_core.checkpoint.damage import CheckpointDamage, describe, is_damage
from layout_core.checkpoint.files import MANIFEST, checkpoint_dirs, validate
from layout_core.checkpoint.frozen_base import CheckpointView
from layout_core.checkpoint.matching import check_fits
from layout_core.errors import ConfigError
from layout_core.lazy import tf
from layout_core.train.loop import Trainer
from plugins.plan import RunPlan
from plugins.training import build_trainer

CONFIG_FILE = 'config.gin'     # the run's operative config, beside its checkpoints too
_RESTORED = ('model', 'counters')  # the parts of a checkpoint inference needs


@dataclasses.dataclass(frozen=True)
class Trained:
  """A run's model built on a mesh with a checkpoint's values in it."""
  trainer: Trainer    # the loop around the engine: `evaluate()` is training's evaluation
  mesh: Any           # the whole mesh the model is laid out on
  step: int           # the step the checkpoint was saved at
  checkpoint: str     # its prefix (`.../checkpoints/ckpt-300/ckpt`)
  plan: RunPlan       # the plan the model was built from

  @property
  def engine(self):
    """The step engine (`layout_core.train.engine.StepEngine`) holding the variables."""
    return self.trainer.engine

  @property
  def variables(self) -> dict[str, Any]:
    """path -> variable, with the checkpoint's values."""
    return dict(self.engine.variables)

  @property
  def model(self):
    """The `layout_core.model.built.BuiltModel` (`.call(inputs, training)`),
    for engines that run the model as one program; ConfigError for a
    pipelined one, whose model is a schedule rather than one call."""
    program = getattr(self.engine, 'program', None)
    model = getattr(program, 'model', None)
    if model is None or model.call is None:
      raise ConfigError(
          f'the model was built with its pipeline ({self.plan.pipeline.engine} engine): '
          'it runs as a pipeline schedule, not as one call',
          where='pipeline.num_stages',
          fix='load it with load_trained(plan, ..., pipelined=False) (the same checkpoint '
              'loads into the unpipelined model), or use a config without the pipeline '
              '(pipeline.num_stages = 1, one micro-batch)')
    return model


def find_checkpoint(*, model_dir: str | None = None,
                    checkpoint: str | None = None) -> tuple[int | None, str]:
  """(step, prefix) of the checkpoint to load, reading only.

  `checkpoint`: a prefix (`.../ckpt-300/ckpt`) or a `ckpt-N` directory,
  refused when damaged. Otherwise the newest complete, undamaged checkpoint
  in `model_dir/checkpoints` (a damaged newer one is skipped with a
  warning). The step is None only for a prefix without meshgin's manifest."""
  if checkpoint:
    step, prefix = _named_checkpoint(checkpoint)
    return step, os.path.abspath(prefix)
  if not model_dir:
    raise ConfigError('neither a model_dir nor a checkpoint is given', where='the command line',
                      fix='add --model_dir=<the run\'s directory> or --checkpoint=<a ckpt-N '
                          'directory or prefix>')
  directory = os.path.join(model_dir, 'checkpoints')
  found = checkpoint_dirs(directory)
  for step, path in found:
    problem = validate(path, check_contents=True)
    if problem is None:
      return step, os.path.abspath(os.path.join(path, 'ckpt'))
    logging.warning('Skipping checkpoint %s: %s', path, problem)
  if not os.path.isdir(model_dir):
    raise ConfigError(f'--model_dir {model_dir!r} does not exist', where='--model_dir',
                      fix='give the directory a launch.train run wrote')
  what = (f'{len(found)} checkpoint(s) there, none complete and undamaged' if found
          else 'no checkpoint there')
  raise ConfigError(f'{directory} holds {what}', where='--model_dir',
                    fix='give the model_dir of a run that saved a checkpoint (launch.train '
                        'saves at the end and every checkpoint.every_steps), or '
                        '--checkpoint=<a ckpt-N directory>')


def _named_checkpoint(checkpoint: str) -> tuple[int | None, str]:
  prefix = checkpoint.rstrip('/')
  if os.path.isdir(prefix):
    if os.path.isdir(os.path.join(prefix, 'checkpoints')):  # a model_dir given here
      return find_checkpoint(model_dir=prefix)
    prefix = os.path.join(prefix, 'ckpt')
  if not tf.io.gfile.exists(prefix + '.index'):
    raise ConfigError(f'no checkpoint at {checkpoint!r} ({prefix}.index does not exist)',
                      where='--checkpoint',
                      fix='give a ckpt-N directory (model_dir/checkpoints/ckpt-N), its '
                          'prefix (.../ckpt-N/ckpt), or use --model_dir for the newest one')
  directory = os.path.dirname(prefix)
  if not os.path.isfile(os.path.join(directory, MANIFEST)):
    return None, prefix  # a plain tf.train checkpoint: nothing to check it against
  problem = validate(directory, check_contents=True)
  if problem is not None:
    raise ConfigError(f'the checkpoint {directory} is damaged: {problem}',
                      where='--checkpoint', fix='give another ckpt-N of the run (its files '
                      'were left as they are)')
  name = os.path.basename(directory)
  step = int(name[len('ckpt-'):]) if name[len('ckpt-'):].isdigit() else None
  return step, prefix


def config_files(*, model_dir: str | None, checkpoint: str | None, gin_files: Sequence[str],
                 from_run: bool = True) -> list[str]:
  """The gin files of a run read back: its own config (`run_config` below),
  then `gin_files` on top; only `gin_files` when `from_run` is False
  (--norun_config)."""
  if from_run:
    return [run_config(model_dir=model_dir, checkpoint=checkpoint), *gin_files]
  if not gin_files:
    raise ConfigError('--norun_config and no --gin_file: there is no config', where='--gin_file',
                      fix='give the config with --gin_file, or leave out --norun_config')
  return list(gin_files)


def run_config(*, model_dir: str | None = None, checkpoint: str | None = None) -> str:
  """The path of the config the checkpoint was trained with: the named
  checkpoint's own `config.gin` (every meshgin checkpoint holds one), else
  `model_dir/config.gin`, else the newest checkpoint's. ConfigError when none exists."""
  candidates = []
  if checkpoint:
    path = checkpoint.rstrip('/')
    directory = path if os.path.isdir(path) else os.path.dirname(path)
    candidates.append(os.path.join(directory, CONFIG_FILE))  # a ckpt-N's, or a model_dir's
  if model_dir:
    candidates.append(os.path.join(model_dir, CONFIG_FILE))
    candidates += [os.path.join(path, CONFIG_FILE)
                   for _, path in checkpoint_dirs(os.path.join(model_dir, 'checkpoints'))]
  for candidate in candidates:
    if os.path.isfile(candidate):
      return os.path.normpath(candidate)
  looked = ', '.join(os.path.normpath(c) for c in candidates) or 'nowhere (no directory given)'
  raise ConfigError(f'no {CONFIG_FILE} of the run found (looked at {looked})',
                    where='--model_dir / --checkpoint',
                    fix='give the model_dir of a launch.train run, or give the config '
                        'yourself with --gin_file (and --norun_config)')


def load_trained(plan: RunPlan, *, model_dir: str | None = None,
                 checkpoint: str | None = None, pipelined: bool = True) -> Trained:
  """Builds `plan`'s model on its mesh and reads the checkpoint into it
  (`find_checkpoint` says which), writing nothing (see the module doc).

  `pipelined=False` builds a pipelined plan's model without its pipeline
  (one program on the whole mesh), which reads the same checkpoint."""
  step, prefix = find_checkpoint(model_dir=model_dir, checkpoint=checkpoint)
  if not pipelined and plan.pipeline is not None:
    plan = dataclasses.replace(plan, pipeline=None)  # build_trainer then ignores pipeline.*
  trainer = build_trainer(plan)  # writer and profile dir left out: nothing is written
  state = trainer.state()
  parts = {name: state[name] for name in _RESTORED}
  entries = shard_io.checkpoint_entries(parts)
  try:
    view = CheckpointView(prefix, moved_to=plan.checkpoint.moved_base)  # and its base's
  except CheckpointDamage as e:
    raise _damaged(prefix, e) from None
  try:
    check_fits(prefix, entries, roots=[shard_io.escape(name) + '/' for name in parts],
               saved=view.shapes)
  except ConfigError as e:
    raise ConfigError(e.message, where='the config (--gin_file / --gin_bindings)',
                      fix='use the config of the run that wrote the checkpoint (its '
                          'config.gin; only mesh.shape and layout_rules may differ); the '
                          'checkpoint was left untouched') from None
  except CheckpointDamage as e:
    raise _damaged(prefix, e) from None
  try:
    view.read(entries)
  except Exception as e:  # pylint: disable=broad-except  # all but damage re-raised
    if not is_damage(e):
      raise
    raise _damaged(prefix, e) from None
  restored_step = trainer.current_step
  if step is not None and restored_step != step:
    logging.warning('%s is named for step %d but holds step %d', prefix, step, restored_step)
  logging.info('Loaded %s (step %d) into %s', prefix, restored_step,
               plan.mesh_spec.describe())
  return Trained(trainer=trainer, mesh=trainer.engine.mesh, step=restored_step,
                 checkpoint=prefix, plan=plan)


def _damaged(prefix: str, error: BaseException) -> ConfigError:
  return ConfigError(f'reading the checkpoint {prefix} failed: {describe(error)}',
                     where='--checkpoint / --model_dir',
                     fix='give another ckpt-N of the run with --checkpoint (nothing was moved '
                         'or changed)')


@dataclasses.dataclass(frozen=True)
class Decoder:
  """A run's language model ready to decode (`load_decoder`)."""
  plan: RunPlan
  layers: Any      # layout_core.infer.lm_layers.LMLayers: vocab_size, max_len, ...
  tokenizer: Any   # layout_core.infer.tokens.Tokenizer
  trained: Trained
  lm: Any          # layout_core.infer.decode.CachedLM on the run's mesh


def load_decoder(*, files: Sequence[str], bindings: Sequence[str] = (),
                 search_paths: Sequence[str] = (), model_dir: str | None = None,
                 checkpoint: str | None = None, spm_model: str | None = None,
                 check: Callable[[RunPlan, Any, Any], None] | None = None) -> Decoder:
  """The model of `files` + `bindings` (a run's config: `config_files`) with
  the checkpoint read into it, unpipelined, as a `CachedLM`, and the run's
  tokenizer (or `spm_model`): what `launch.decode` and `plugins.lm_eval`
  decode with. Everything that needs no weights is checked first (the model
  is a Transformer LM, the tokenizer's vocabulary fits it, then
  `check(plan, layers, tokenizer)`: the caller's own, e.g. its prompts), so
  a mistake there is a ConfigError before any checkpoint is read."""
  # pylint: disable=g-import-not-at-top
  from layout_core.infer import decode, tokens
  from plugins import gin_setup, plan as plan_lib
  with gin_setup.parsed_config(files=list(files), bindings=list(bindings),
                               search_paths=list(search_paths)):
    plan = plan_lib.make_plan(data_splits=())  # decoding reads no data
    layers = decode.lm_layers(plan.params)
    tokenizer = tokens.tokenizer_for(plan.task, spm_model=spm_model,
                                     run_dir=run_directory(model_dir=model_dir,
                                                           checkpoint=checkpoint))
    if check is not None:
      check(plan, layers, tokenizer)
    tokens.check_vocabulary(tokenizer, model_vocab=layers.vocab_size,
                            task_vocab=getattr(plan.task, 'vocab_size', None))
    trained = _load_unpipelined(plan, model_dir=model_dir, checkpoint=checkpoint)
    lm = decode.CachedLM(plan.params, trained.variables, batch_axis=plan.train.batch_axis)
  return Decoder(plan=plan, layers=layers, tokenizer=tokenizer, trained=trained, lm=lm)


def run_directory(*, model_dir: str | None, checkpoint: str | None) -> str | None:
  """The run's directory: `model_dir`, or the one holding a named checkpoint
  (`<run>/checkpoints/ckpt-N[/ckpt]`); None when neither says."""
  if model_dir:
    return model_dir
  if not checkpoint:
    return None
  path = os.path.abspath(checkpoint.rstrip('/'))
  directory = path if os.path.isdir(path) else os.path.dirname(path)
  if os.path.isdir(os.path.join(directory, 'checkpoints')):  # a model_dir given as --checkpoint
    return directory
  parent = os.path.dirname(directory)
  return os.path.dirname(parent) if os.path.basename(parent) == 'checkpoints' else None


def _load_unpipelined(plan: RunPlan, *, model_dir: str | None,
                      checkpoint: str | None) -> Trained:
  """The run's model with the checkpoint in it, as one program on the whole
  mesh (a pipelined run's checkpoint has the unpipelined model's keys)."""
  try:
    return load_trained(plan, model_dir=model_dir, checkpoint=checkpoint, pipelined=False)
  except ConfigError as e:
    if plan.pipeline is None:
      raise
    raise ConfigError(f"this pipelined run's checkpoint does not load into its model without "
                      f'the pipeline, which decoding needs: {e.message}',
                      where='the checkpoint (--model_dir / --checkpoint)',
                      fix="decode a checkpoint whose keys are the plain model's (meshgin's "
                          'pipelines save those), or train without a pipeline') from None
