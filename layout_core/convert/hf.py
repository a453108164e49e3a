"""Hugging Face checkpoints in and out of meshgin: the library side (no gin, no flags).

    source = open_hf('downloads/llama')      # config.json + safetensors, checked
    source.kwargs                            # transformer_lm(**kwargs) is the model
    for path, value in source.values():      # one tensor at a time, meshgin's layout
      assign(variables[path], value)

    write_hf_dir('exports/llama-hf', kwargs=kwargs, read=lambda path: value_of(path),
                 tokenizer_dir='runs/llama/tokenizer')

`open_hf` reads `config.json` (`layout_core.convert.hf_config`), opens the
weights (`layout_core.convert.hf_files`) and checks every tensor's name and
shape against the family's table (`layout_core.convert.hf_names`) before a
value is read: a tensor missing, one the table does not know (buffers
such as `rotary_emb.inv_freq` aside), one of another shape, or one stored
in a dtype other than F32, F16 or BF16 (integers, bools, 8-bit floats) is a
ConfigError naming it (and its file); so is a config.json with a
`quantization_config`. `values()` then yields each meshgin variable's value,
converted from one Hugging Face tensor at a time, in float32 (bfloat16 and
float16 widen exactly).

`write_hf_dir` is the inverse: the run's variables, read one at a time by
`read(path)`, become the family's tensors (float32, or `dtype`), sharded over
`max_shard_bytes`, with config.json and the tokenizer files (its chat
template among them), in a directory that appears whole (written beside it,
renamed). config.json's `bos_token_id` and `eos_token_id`, and a
`generation_config.json` where the run kept none, come from the imported
config and the tokenizer: EOS includes the chat template's end-of-turn
token (`layout_core.convert.hf_tokens`). It writes the embedding
once and `tie_word_embeddings: true` when the model ties its embeddings
(`transformer_lm.tie_embeddings`) or `lm/softmax/w` is exactly the
embedding table transposed, else both matrices and `false`.

The plugin side (`plugins.hf`) builds the run around these: the mesh, the
layout, the checkpoint and config.gin.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import shutil
from typing import Any, Callable, Iterator, Mapping

import numpy as np

from layout_core.convert import hf_config, hf_files, hf_names, hf_tokens
from layout_core import durable
from layout_core.errors import ConfigError

# Files of a Hugging Face tokenizer that an import copies into the run (those present).
TOKENIZER_FILES = ('tokenizer.json', 'tokenizer_config.json', 'special_tokens_map.json',
                   'tokenizer.model', 'vocab.json', 'merges.txt', 'added_tokens.json',
                   'chat_template.jinja', 'chat_template.json', 'generation_config.json')
GENERATION_CONFIG = 'generation_config.json'

# Safetensors dtypes an import reads (and widens exactly to float32).
FLOAT_DTYPES = ('F32', 'F16', 'BF16')
_DTYPES = {'float32': np.float32, 'bfloat16': 'bfloat16', 'float16': np.float16}


@dataclasses.dataclass
class HFSource:
  """An opened Hugging Face checkpoint, checked against its family's table."""
  directory: str
  config: dict[str, Any]            # config.json as read
  kwargs: dict[str, Any]            # transformer_lm's keyword arguments
  facts: hf_config.HFFacts          # family, tied, torch_dtype
  rules: list[hf_names.TensorRule]
  reader: hf_files.SafetensorsReader

  @property
  def variable_shapes(self) -> dict[str, tuple[int, ...]]:
    """path -> shape of every variable the import fills."""
    return hf_names.variable_shapes(self.rules)

  def values(self) -> Iterator[tuple[str, np.ndarray]]:
    """(variable path, float32 value) for every variable, one Hugging Face
    tensor read at a time."""
    stacked: dict[str, np.ndarray] = {}  # a routed layer's experts, filled one by one
    for rule in self.rules:
      values = rule.to_meshgin(self.reader.read(rule.hf_name), np.float32)
      if rule.expert is not None:
        (path,), (shape,) = rule.paths, rule.shapes
        stacked.setdefault(path, np.empty(shape, np.float32))[rule.expert] = values[0]
        if rule.expert == shape[0] - 1:
          yield path, stacked.pop(path)
        continue
      for path in rule.paths:
        yield path, values.pop(0)  # handed over: the caller's is the only reference


def open_hf(directory: str) -> HFSource:
  """The checkpoint in `directory`, every tensor name and shape checked (module doc)."""
  config = hf_files.read_config(directory)
  source_name = os.path.join(directory, 'config.json')
  if config.get('quantization_config') is not None:
    method = (config['quantization_config'].get('quant_method', '?')
              if isinstance(config['quantization_config'], dict) else '?')
    raise ConfigError(f'{source_name}: quantization_config is set (quant_method {method!r}): '
                      'the weights are quantized, and meshgin reads float32, float16 and '
                      'bfloat16 weights only', where=f'{source_name}, field '
                      "'quantization_config'", fix='import the unquantized checkpoint the '
                      'quantized one was made from')
  kwargs, facts = hf_config.lm_kwargs_from_hf(config, source=source_name)
  reader = hf_files.SafetensorsReader(directory)  # holds no file open
  prefix = hf_names.gpt2_prefix(list(reader.shapes)) if facts.family == 'gpt2' else ''
  rules = hf_names.tensor_rules(kwargs, family=facts.family, tied=facts.tied, prefix=prefix)
  check_tensors(reader, rules, family=facts.family, directory=directory, tied=facts.tied)
  check_dtypes(reader, [rule.hf_name for rule in rules])
  return HFSource(directory=directory, config=config, kwargs=kwargs, facts=facts, rules=rules,
                  reader=reader)


def check_tensors(reader: hf_files.SafetensorsReader, rules, *, family: str, directory: str,
                  tied: bool) -> None:
  """ConfigError listing the tensors missing, unknown or of another shape."""
  expected = {rule.hf_name: rule.hf_shape for rule in rules}
  missing = [name for name in expected if name not in reader.shapes]
  wrong = [f'{name} is {list(reader.shapes[name])}, config.json makes it {list(shape)}'
           for name, shape in expected.items()
           if name in reader.shapes and reader.shapes[name] != shape]
  # A tied checkpoint may still carry the output matrix (a copy): it is not read.
  spare = {'lm_head.weight'} if tied else set()
  extra = [name for name in reader.shapes if name not in expected and name not in spare
           and not hf_names.is_ignored(name, family)]
  problems = []
  if missing:
    problems.append(f'{len(missing)} tensor(s) missing: {", ".join(missing[:4])}'
                    + (' ...' if len(missing) > 4 else ''))
  if wrong:
    problems.append(f'{len(wrong)} of another shape: {"; ".join(wrong[:4])}'
                    + (' ...' if len(wrong) > 4 else ''))
  if extra:
    problems.append(f'{len(extra)} tensor(s) a {family} model does not have: '
                    f'{", ".join(sorted(extra)[:4])}' + (' ...' if len(extra) > 4 else ''))
  if problems:
    raise ConfigError(f'the weights in {directory} are not the model its config.json '
                      f'describes: {"; ".join(problems)}', where=directory,
                      fix='give the config.json and safetensors of one checkpoint, '
                          'downloaded whole')


def check_dtypes(reader: hf_files.SafetensorsReader, names) -> None:
  """ConfigError naming the tensors (and files) among `names` stored in a
  dtype other than FLOAT_DTYPES: an integer, bool or 8-bit float tensor
  under a weight's name is not a weight meshgin can widen exactly."""
  wrong = [f'{name} is {reader.dtypes[name]} (in {reader.file_of[name]})'
           for name in dict.fromkeys(names) if reader.dtypes.get(name, 'F32') not in FLOAT_DTYPES]
  if wrong:
    raise ConfigError(
        f'{len(wrong)} tensor(s) in {reader.directory} are not float32, float16 or '
        f'bfloat16: {"; ".join(wrong[:4])}' + (' ...' if len(wrong) > 4 else ''),
        where=reader.directory, fix='import a checkpoint saved in float32, float16 or '
                                    'bfloat16 (not quantized)')


# -- export ---------------------------------------------------------------------------------
def is_tied(embedding: np.ndarray, output: np.ndarray) -> bool:
  """Whether the output matrix [D, V] is exactly the embedding [V, D] transposed."""
  return embedding.shape == output.shape[::-1] and np.array_equal(embedding, output.T)


def check_target(target: str, *, overwrite: bool) -> None:
  """ConfigError when `target` exists (a file, or a directory without `overwrite`)."""
  if os.path.exists(target) and (not overwrite or not os.path.isdir(target)):
    raise ConfigError(f'{target} exists', where='--export_dir',
                      fix='give a new directory, or add --overwrite to replace it')


def write_hf_dir(target: str, *, kwargs: Mapping[str, Any],
                 read: Callable[[str], np.ndarray], dtype: str = 'float32',
                 max_shard_bytes: int = hf_files.DEFAULT_MAX_SHARD_BYTES,
                 tokenizer_dir: str | None = None, kept: Mapping[str, Any] | None = None,
                 overwrite: bool = False) -> dict[str, Any]:
  """Writes transformer_lm(**kwargs)'s weights (`read(path)` gives each
  variable's global value) as a Hugging Face directory at `target` (module
  doc). Returns what was written: family, tied, files."""
  if dtype not in _DTYPES:
    raise ConfigError(f'dtype {dtype!r} is not one of {sorted(_DTYPES)}', where='--hf_dtype',
                      fix="use 'float32' (exact) or 'bfloat16'")
  check_target(target, overwrite=overwrite)
  family = hf_config.family_of(kwargs)
  shapes = hf_names.variable_shapes(hf_names.tensor_rules(kwargs, family=family, tied=False))

  @functools.lru_cache(maxsize=1)  # a routed layer's experts: one read for all E
  def checked(path: str) -> np.ndarray:
    value = np.asarray(read(path))
    if tuple(value.shape) != shapes[path]:
      raise ConfigError(f'{path} is {list(value.shape)} in the checkpoint, but the config '
                        f'makes it {list(shapes[path])}', where='the run\'s config.gin',
                        fix='export with the config the checkpoint was trained with')
    return value
  tied = (hf_config.resolved(kwargs)['tie_embeddings']
          or is_tied(checked('lm/emb/table'), checked('lm/softmax/w')))
  config = hf_config.hf_config_from_lm(kwargs, tied=tied, dtype=dtype, kept=kept)
  config.update(hf_tokens.token_fields(tokenizer_dir, kept=kept))
  prefix = 'transformer.' if family == 'gpt2' else ''
  rules = hf_names.tensor_rules(kwargs, family=family, tied=tied, prefix=prefix)
  by_name = {}
  for rule in rules:
    by_name.setdefault(rule.hf_name, rule)  # tied: the embedding's own rule writes it
  np_dtype = np.dtype(_DTYPES[dtype]) if dtype != 'bfloat16' else _bfloat16()
  sizes = [(name, hf_files.nbytes(rule.hf_shape, np_dtype)) for name, rule in by_name.items()]

  def tensor(name: str) -> np.ndarray:
    rule = by_name[name]
    return rule.to_hf([checked(path) for path in rule.paths]).astype(np_dtype)

  with durable.directory_aside(target, replace=overwrite) as partial:
    files = hf_files.write_safetensors(partial, tensor, sizes, max_shard_bytes=max_shard_bytes)
    with open(os.path.join(partial, 'config.json'), 'w') as f:
      json.dump(config, f, indent=2)
    files.append('config.json')
    files += copy_tokenizer(tokenizer_dir, partial) if tokenizer_dir else []
    generation = hf_tokens.generation_config(tokenizer_dir, kept=kept)
    if GENERATION_CONFIG not in files and generation:
      with open(os.path.join(partial, GENERATION_CONFIG), 'w') as f:
        json.dump(generation, f, indent=2)
      files.append(GENERATION_CONFIG)
  return {'family': family, 'tied': tied, 'files': files, 'config': config}


def copy_tokenizer(source_dir: str, target_dir: str) -> list[str]:
  """Copies the TOKENIZER_FILES that `source_dir` has into `target_dir`; their names."""
  copied = []
  for name in TOKENIZER_FILES:
    path = os.path.join(source_dir, name)
    if os.path.isfile(path):
      shutil.copyfile(path, os.path.join(target_dir, name))
      copied.append(name)
  return copied


def _bfloat16() -> np.dtype:
  import ml_dtypes  # pylint: disable=g-import-not-at-top  # TensorFlow's own dependency
  return np.dtype(ml_dtypes.bfloat16)
