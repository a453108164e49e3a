"""Hugging Face models as meshgin runs and back: the run side of `layout_core.convert.hf`.

    report = import_run(hf_dir='downloads/llama', model_dir='runs/llama',
                        files=['configs/layouts/megatron.gin'],
                        bindings=["mesh.shape = {'data': 2, 'model': 4}"])
    # runs/llama/config.gin, checkpoints/ckpt-0, tokenizer/, hf_import.json
    export_run(model_dir='runs/llama', export_dir='exports/llama-hf')

`import_run` writes a run that every launcher takes as its own
(`launch.train` fine-tunes it from step 0, `launch.eval`, `launch.decode`,
`launch.export` read it, `checkpoint.init_from` starts another run from it):

  config.gin        the operative config: transformer_lm's arguments from the
                    checkpoint's config.json (`hf_config`), the Markov task
                    at the model's vocabulary (`data.vocab_size`; set your own
                    data to train), mesh.shape {'data': 1} unless `files` or
                    `bindings` choose a mesh and layout rules
  checkpoints/ckpt-0  a step-0 checkpoint of the model's weights (the
                    optimizer's state starts fresh), streamed to disk: each
                    converted tensor written whole as it is read (one
                    Hugging Face tensor in host memory at a time, nothing
                    built on a mesh; any mesh and layout restore it), in
                    bfloat16 when the checkpoint is (`stored_dtype`), then
                    committed by the run's own checkpointer
  tokenizer/        the model's tokenizer files (`layout_core.infer.tokens`
                    uses them: `launch.decode --prompt='text'`)
  hf_import.json    where it came from: the directory, family, whether the
                    embeddings were tied, and config.json as read

Everything is checked before anything is written (the config, every
tensor's name and shape, the mesh, that `bindings` leave the architecture
alone), and the run is written beside `model_dir` and renamed: an import
that fails leaves nothing. `export_run` reads a run's checkpoint (any mesh,
layout or pipeline: checkpoints hold the plain model's keys) one variable at
a time and writes config.json, safetensors and the tokenizer
(`layout_core.convert.hf.write_hf_dir`).
"""

from __future__ import annotations

import ctypes
import dataclasses
import itertools
import json
import os
import tempfile
import time
from typing import Any, Callable, Sequence

import gin
import numpy as np
from absl import logging

from layout_core.checkpoint.frozen_base import open_view
from layout_core.checkpoint.manager import Checkpointer
from layout_core.checkpoint.matching import key_for_name, names_in
from layout_core.checkpoint import shard_io
from layout_core.convert import hf as hf_lib
from layout_core.convert import peft
from layout_core.durable import directory_aside
from layout_core.errors import ConfigError
from layout_core.infer.tokens import RUN_TOKENIZER_DIR
from layout_core.lazy import tf
from layout_core.layout.variables import variable_creator
from layout_core.model import frozen
from layout_core.model import lora as lora_lib
from layout_core.model import tuning as tuning_lib
from layout_core.train.engine import Counters
from plugins import configurables, gin_setup, inference
from plugins.origin import IMPORT_RECORD, base_run, origin_of
from plugins.plan import check_model_dir, make_plan

DEFAULT_SEQ_LEN = 64   # the Markov task's rows in an imported run's config (capped by max_len)
_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter


@dataclasses.dataclass(frozen=True)
class ImportReport:
  model_dir: str
  family: str
  tied: bool
  num_parameters: int
  mesh: str
  seconds: float

  def line(self) -> str:
    return (f'Imported a {self.family} model ({self.num_parameters:,} parameters'
            f'{", tied embeddings" if self.tied else ""}) into {self.model_dir} on '
            f'{self.mesh} in {self.seconds:.1f} s: config.gin, checkpoints/ckpt-0')


def base_config(kwargs: dict[str, Any]) -> str:
  """The gin text an imported run starts from (before the user's files and
  bindings): the model, the Markov task at its vocabulary, one device."""
  lines = ['# Written by launch.import_hf: the architecture of the imported checkpoint.',
           'model.params = @transformer_lm()']
  for name, value in kwargs.items():
    if name == 'moe':  # a mixture of experts: moe_feed_forward's arguments
      lines.append('transformer_lm.moe = @moe_feed_forward()')
      lines += [f'moe_feed_forward.{key} = {v!r}' for key, v in value.items()]
    else:
      lines.append(f'transformer_lm.{name} = {value!r}')
  seq_len = min(DEFAULT_SEQ_LEN, kwargs['max_len']) if kwargs.get('max_len') else DEFAULT_SEQ_LEN
  lines += [f'data.vocab_size = {kwargs["vocab_size"]}', f'data.seq_len = {seq_len}',
            "mesh.shape = {'data': 1}"]
  return '\n'.join(lines) + '\n'


def check_new_run(model_dir: str, *, overwrite: bool) -> None:
  """ConfigError unless `model_dir` can become the imported run."""
  check_model_dir(model_dir)
  if os.path.isdir(model_dir) and os.listdir(model_dir) and not overwrite:
    raise ConfigError(f'--model_dir {model_dir} exists and is not empty', where='--model_dir',
                      fix='give a new directory, or add --overwrite to replace that run')


def _check_architecture_kept(kwargs: dict[str, Any]) -> None:
  """ConfigError when the user's files or bindings changed an argument the weights fix."""
  bound_kwargs = lm_kwargs_of_config(exact=False)
  for name, value in kwargs.items():
    bound = bound_kwargs.get(name)
    if name == 'moe' and isinstance(bound, dict):  # the arguments the checkpoint fixes
      bound = {key: bound.get(key) if key not in hf_lib.hf_config.MOE_TRAINING else v
               for key, v in value.items()}
    if bound != value:
      raise ConfigError(
          f'transformer_lm.{name} is {bound!r} in the given config, but the checkpoint '
          f'is {value!r}', where=f'transformer_lm.{name} (--gin_file / --gin_bindings)',
          fix='leave the architecture as the checkpoint has it; choose only the mesh, '
              'the layout rules and training settings')


def return_freed_memory_promptly() -> None:
  """Makes glibc serve blocks over 1 MiB from their own mappings, handed
  back to the system when freed. An import frees one converted tensor after
  another, and glibc's default threshold rises to the size of each block
  freed, keeping the next ones in its heap: 0.8 GiB more at the peak of
  `bench/import_hf.py`'s 1.1B-parameter import. Process-wide, so called by
  the import's own process (`launch.import_hf`); nothing where the C library
  has no `mallopt`."""
  try:
    ctypes.CDLL(None).mallopt(_M_MMAP_THRESHOLD, 1 << 20)
  except (OSError, AttributeError):
    pass


def import_run(*, hf_dir: str, model_dir: str, files: Sequence[str] = (),
               bindings: Sequence[str] = (), search_paths: Sequence[str] = (),
               overwrite: bool = False, on_write: Callable[[], None] | None = None,
               peft_dir: str | None = None, weights_dtype: str = 'auto') -> ImportReport:
  """Writes the run of the Hugging Face checkpoint in `hf_dir` (module doc).
  `on_write` is called once everything is checked, right before the first
  file is written (launch.import_hf defers stop signals there). `peft_dir`:
  LoRA adapters saved by PEFT for that model, which the run then carries
  (its config binds `lora.*` to theirs). `weights_dtype`: what the step-0
  checkpoint stores the weights in ('auto': `stored_dtype`)."""
  start = time.perf_counter()
  check_new_run(model_dir, overwrite=overwrite)
  adapters, adapter_tensors = peft.read_peft_dir(peft_dir) if peft_dir else (None, {})
  if adapters is not None:
    bindings = [*bindings, *(f'lora.{field} = {getattr(adapters, field)!r}'
                             for field in ('rank', 'alpha', 'dropout', 'targets'))]
  source = hf_lib.open_hf(hf_dir)
  weights_dtype = stored_dtype(source, weights_dtype)
  with tempfile.TemporaryDirectory(prefix='meshgin-import-') as scratch:
    base = os.path.join(scratch, 'imported.gin')
    with open(base, 'w') as f:
      f.write(base_config(source.kwargs))
    with gin_setup.parsed_config(files=[base, *files], bindings=list(bindings),
                                 search_paths=list(search_paths)):
      plan = make_plan(data_splits=())  # the import reads no data
      _check_architecture_kept(source.kwargs)
  # The weights as the step-0 checkpoint holds them: frozen for this write,
  # so in `weights_dtype` (LoRA adapters from a PEFT import stay float32).
  held = tuning_lib.tuned(plan.params, lora_lib.Tuning(
      lora=tuning_lib.lora_of(plan.params), trainable=(), frozen_dtype=weights_dtype))
  specs = {spec.path: spec for spec in held.cls.variable_specs(held)}
  shapes = {path: tuple(spec.shape) for path, spec in specs.items()}
  adapted = peft.meshgin_adapters(source.kwargs, adapter_tensors, shapes) if adapters else {}
  _check_variables(shapes, {**source.variable_shapes,
                            **{path: v.shape for path, v in adapted.items()}}, hf_dir=hf_dir)
  if on_write is not None:
    on_write()
  values = ((path, value.astype(tf.as_dtype(specs[path].dtype).as_numpy_dtype, copy=False))
            for path, value in itertools.chain(source.values(), adapted.items()))
  record = {'hf_dir': os.path.abspath(hf_dir), 'family': source.facts.family,
            'weights_dtype': weights_dtype,
            'peft_dir': os.path.abspath(peft_dir) if peft_dir else None,
            'tied': source.facts.tied, 'torch_dtype': source.facts.dtype,
            'kwargs': source.kwargs, 'config': source.config}
  _write_run(model_dir, params=held, values=values, plan=plan, hf_dir=hf_dir, record=record,
             overwrite=overwrite)
  return ImportReport(model_dir=model_dir, family=source.facts.family, tied=source.facts.tied,
                      num_parameters=plan.num_parameters, mesh=plan.mesh_spec.describe(),
                      seconds=time.perf_counter() - start)


WEIGHTS_DTYPES = ('auto', 'float32', 'bfloat16')


def stored_dtype(source: hf_lib.HFSource, requested: str) -> str:
  """The dtype an import stores the weights of `source` in: `requested`,
  or for 'auto' bfloat16 where every tensor it reads is BF16 (held bit for
  bit, half float32's bytes), else float32 (float16 widens exactly)."""
  if requested not in WEIGHTS_DTYPES:
    raise ConfigError(f'--weights_dtype is {requested!r}', where='--weights_dtype',
                      fix=f"use one of {', '.join(WEIGHTS_DTYPES)}")
  if requested != 'auto':
    return requested
  names = [rule.hf_name for rule in source.rules]
  return ('bfloat16' if all(source.reader.dtypes.get(n) == 'BF16' for n in names)
          else 'float32')


def _check_variables(built: dict[str, tuple[int, ...]], expected: dict[str, tuple[int, ...]],
                     *, hf_dir: str) -> None:
  """ConfigError unless the model (`built`: path -> shape) has exactly the
  variables the import fills."""
  if built == expected:
    return
  only_model = sorted(set(built) - set(expected))
  only_hf = sorted(set(expected) - set(built))
  shapes = [f'{p}: model {list(built[p])}, checkpoint {list(expected[p])}'
            for p in sorted(set(built) & set(expected)) if built[p] != expected[p]]
  raise ConfigError(
      f'the model transformer_lm builds does not take the weights of {hf_dir}: variables '
      f'only in the model {only_model[:4]}, only in the checkpoint {only_hf[:4]}, other '
      f'shapes {shapes[:4]}', where='transformer_lm (--gin_file / --gin_bindings)',
      fix='import without bindings that change the model')


def checkpoint_skeleton(params) -> tuple[dict[str, Any], dict[str, str]]:
  """(the state a run of `params` checkpoints, its variables empty
  placeholders: nothing allocated; the key of each, by variable path, and of
  the counters by key): what names a checkpoint streamed to disk."""
  paths: dict[int, str] = {}

  def placeholder(spec):
    variable = tf.Variable(tf.zeros([0], spec.dtype), trainable=False,
                           name=spec.path.rsplit('/', 1)[-1])
    paths[id(variable)] = spec.path
    return variable
  with variable_creator(placeholder):
    module = params.Instantiate()
  state = {'model': module, 'counters': Counters(None).module}
  keys = {paths.get(id(e.variable), e.key): e.key for e in shard_io.checkpoint_entries(state)}
  return state, keys


def _write_run(model_dir: str, *, params, values, plan, hf_dir: str, record: dict,
               overwrite: bool) -> None:
  """The run's files, written beside `model_dir` and renamed into place; its
  step-0 checkpoint streamed to disk, each of `values` ((path, host value)
  of every variable of `params`) written as it comes, then merged: nothing
  is built on a mesh, and one tensor is in memory at a time."""
  state, keys = checkpoint_skeleton(params)
  with directory_aside(model_dir, replace=overwrite) as partial:
    os.makedirs(os.path.join(partial, RUN_TOKENIZER_DIR))
    checkpointer = Checkpointer(
        directory=os.path.join(partial, 'checkpoints'), state=state,
        config=plan.checkpoint, extra_files={'config.gin': plan.operative_config})
    checkpointer.prepare_directory()

    def write(directory: str) -> int:
      number = 0
      for path, value in values:
        shard_io.write_tensor_part(directory, number, keys.pop(path), value)
        number += 1
        del value  # before the next tensor is read
      for key in keys.values():  # the counters: step 0
        shard_io.write_tensor_part(directory, number, key, np.zeros([], np.int64))
        number += 1
      return number
    checkpointer.save_written(0, reason='import', write=write)
    hf_lib.copy_tokenizer(hf_dir, os.path.join(partial, RUN_TOKENIZER_DIR))
    for name, text in (('config.gin', plan.operative_config),
                       (IMPORT_RECORD, json.dumps(record, indent=1, default=str))):
      with open(os.path.join(partial, name), 'w') as f:
        f.write(text)
  logging.info('Wrote %s', model_dir)


# -- export -----------------------------------------------------------------------------
def lm_kwargs_of_config(exact: bool = True) -> dict[str, Any]:
  """transformer_lm's arguments in the parsed gin config (its defaults, then
  the bound values; a mixture of experts' `moe` as moe_feed_forward's
  arguments); ConfigError unless `model.params` is exactly
  transformer_lm(**those) (`exact` False: not checked)."""
  kwargs = dict(hf_lib.hf_config.LM_DEFAULTS)
  kwargs.update(gin.get_bindings(configurables.transformer_lm))
  if kwargs.get('moe') is not None:  # @moe_feed_forward(): its arguments, as a dict
    kwargs['moe'] = {name: value for name, value in {
        **hf_lib.hf_config.MOE_DEFAULTS,
        **gin.get_bindings(configurables.moe_feed_forward)}.items()}
  if not exact:
    return kwargs
  built = configurables.model()
  if kwargs.get('cells') or hf_lib.hf_config.lm_params(kwargs) != built:
    raise ConfigError('the run\'s model is not transformer_lm with its arguments alone '
                      '(cells, model.overrides or another model)', where='model.params',
                      fix='export it in meshgin\'s format (launch.export without --format=hf)')
  # Not the architecture: the root's name (checkpoint keys are below it) and dropout.
  for name in ('name', 'cells', 'dropout_rate'):
    kwargs.pop(name, None)
  return kwargs


def export_run(*, export_dir: str, model_dir: str | None = None,
               checkpoint: str | None = None, files: Sequence[str] = (),
               bindings: Sequence[str] = (), search_paths: Sequence[str] = (),
               overwrite: bool = False, dtype: str = 'auto',
               max_shard_bytes: int = hf_lib.hf_files.DEFAULT_MAX_SHARD_BYTES,
               adapters_only: bool = False) -> dict[str, Any]:
  """Writes the run's checkpoint as a Hugging Face directory (module doc),
  LoRA adapters merged into their weights; with `adapters_only`, the
  adapters alone in PEFT's format (`layout_core.convert.peft`). Returns what
  was written plus the checkpoint and step."""
  hf_lib.check_target(export_dir, overwrite=overwrite)
  step, prefix = inference.find_checkpoint(model_dir=model_dir, checkpoint=checkpoint)
  with gin_setup.parsed_config(files=list(files), bindings=list(bindings),
                               search_paths=list(search_paths)):
    kwargs = lm_kwargs_of_config()
    adapters = lora_lib.Tuning(lora=configurables.lora()).lora
    trainable = configurables.train().trainable
    init_from = configurables.checkpoint().init_from
    moved_base = configurables.checkpoint().moved_base
  run_dir = inference.run_directory(model_dir=model_dir, checkpoint=checkpoint)
  record, tokenizer_dir = origin_of(run_dir, init_from)
  view = open_view(prefix, moved_to=moved_base)  # frozen weights: in its base
  by_name = names_in(prefix, view.shapes)

  def stored(path: str):
    key = key_for_name(path, by_name)
    if key is None:
      return None
    value = view.get_tensor(key)
    scale = key_for_name(path + frozen.SCALE_SUFFIX, by_name)
    if value.dtype == np.int8 and scale is not None:  # a frozen weight held in int8
      return frozen.dequantized_np(value, view.get_tensor(scale))
    return value

  if adapters_only:
    if adapters is None:
      raise ConfigError('the run has no LoRA adapters (lora.rank is 0)', where='--adapters_only',
                        fix='export the whole model (without --adapters_only)')
    if os.path.exists(export_dir):
      raise ConfigError(f'{export_dir} exists', where='--export_dir', fix='give a new directory')
    base_model = (record or {}).get('hf_dir') or base_run(init_from) or ''
    written = peft.write_peft_dir(export_dir, kwargs=kwargs, lora=adapters, read=stored,
                                  base_model=base_model, trainable=trainable)
    return {**written, 'family': 'PEFT LoRA', 'tied': False, 'checkpoint': prefix,
            'step': step}

  def read(path: str):
    value = stored(path)
    if value is None:
      raise ConfigError(f'the checkpoint {prefix} has no {path}', where='--model_dir',
                        fix='export with the config the checkpoint was trained with')
    a, b = stored(path + lora_lib.A_SUFFIX), stored(path + lora_lib.B_SUFFIX)
    if adapters is not None and a is not None and b is not None:
      return lora_lib.merged(value, a, b, scale=adapters.scale)
    return value

  if dtype == 'auto':  # the base's own: that of the matrices the checkpoint holds
    table = key_for_name('lm/emb/table', by_name)
    dtype = ('bfloat16' if table is not None and view.dtype(table) == tf.bfloat16
             else 'float32')
  written = hf_lib.write_hf_dir(export_dir, kwargs=kwargs, read=read, dtype=dtype,
                                max_shard_bytes=max_shard_bytes, tokenizer_dir=tokenizer_dir,
                                kept=(record or {}).get('config'), overwrite=overwrite)
  return {**written, 'checkpoint': prefix, 'step': step}
