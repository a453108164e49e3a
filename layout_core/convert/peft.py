"""LoRA adapters in Hugging Face PEFT's format, out of a run and back in.

    write_peft_dir('exports/my_adapters', kwargs=kwargs, lora=lora, read=read)
    # adapter_config.json + adapter_model.safetensors, as PEFT saves them
    lora, tensors = read_peft_dir('exports/my_adapters')
    adapters = meshgin_adapters(kwargs, tensors, shapes)   # path -> value

PEFT stores a Linear layer's adapters as `<module>.lora_A.weight` [r, in] and
`<module>.lora_B.weight` [out, r] under `base_model.model.`, the update being
(lora_alpha / r) * B @ A on the [out, in] weight. meshgin's adapters of the
weight W [in..., out...] are A [in..., r] and B [r, out...]
(`layout_core.model.lora`): the same two matrices transposed, with the
weight's input and output dims flattened in the order the Hugging Face
tables (`hf_names`) flatten the weight itself. Llama, Mistral and Qwen2
blocks; GPT-2's fused attention projection has no per-head q/k/v modules
to adapt separately (ConfigError).
"""

from __future__ import annotations

import json
import os
import re
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from layout_core.convert import hf_config, hf_names
from layout_core import durable
from layout_core.errors import ConfigError
from layout_core.model.lora import A_SUFFIX, B_SUFFIX, LoraConfig, Tuning

CONFIG_FILE, WEIGHTS_FILE = 'adapter_config.json', 'adapter_model.safetensors'
PREFIX = 'base_model.model.'
# PEFT's module names <-> the weights they are in a transformer_lm block.
MODULES = {'q_proj': 'attn/wq', 'k_proj': 'attn/wk', 'v_proj': 'attn/wv', 'o_proj': 'attn/wo',
           'gate_proj': 'ffn/w_gate', 'up_proj': 'ffn/w_up', 'down_proj': 'ffn/w_down'}
# adapter_config.json fields meshgin does not implement, with the value it would need.
_UNSUPPORTED = {'use_dora': False, 'use_rslora': False, 'bias': 'none', 'rank_pattern': {},
                'alpha_pattern': {}, 'modules_to_save': None, 'fan_in_fan_out': False}


def _linear_rules(kwargs: Mapping[str, Any]) -> list[hf_names.TensorRule]:
  """The block weights PEFT could adapt: one Linear weight per meshgin variable."""
  family = hf_config.family_of(kwargs)
  if family == 'gpt2':
    raise ConfigError('GPT-2 fuses q, k and v into one projection (c_attn), so its LoRA '
                      'adapters have no per-projection PEFT form', where='--adapters_only',
                      fix='export the adapters merged into the weights (without '
                          '--adapters_only)')
  rules = hf_names.tensor_rules(kwargs, family=family, tied=False)
  return [r for r in rules if r.kind == 'linear' and len(r.paths) == 1
          and r.expert is None and r.hf_name.split('.')[-2] in MODULES]


def _check_no_expert_adapters(kwargs: Mapping[str, Any],
                              read: Callable[[str], np.ndarray | None]) -> None:
  """ConfigError when the run has adapters on a routed layer's experts:
  PEFT's files here hold per-projection Linear adapters only."""
  family = hf_config.family_of(kwargs)
  experts = sorted({r.paths[0] for r in hf_names.tensor_rules(kwargs, family=family, tied=False)
                    if r.expert is not None and read(r.paths[0] + A_SUFFIX) is not None})
  if experts:
    raise ConfigError(f'the run has LoRA adapters on {len(experts)} expert weight(s) '
                      f'({experts[0]}, ...), which --adapters_only does not write',
                      where='--adapters_only', fix='export the adapters merged into the '
                      'weights (launch.export --format=hf without --adapters_only)')


def write_peft_dir(target: str, *, kwargs: Mapping[str, Any], lora: LoraConfig,
                   read: Callable[[str], np.ndarray | None], base_model: str = '',
                   trainable: Sequence[str] | None = None) -> dict[str, Any]:
  """Writes the run's adapters (`read(path)`: a variable's value, None if the
  run has no such variable) into the new directory `target`; returns
  {'files', 'modules', 'tensors', 'layers'}. `trainable`: the run's
  `train.trainable`; a base weight it trains is not an adapter, so PEFT's
  files would lose it: ConfigError naming them (export merged instead)."""
  from safetensors.numpy import save_file  # pylint: disable=g-import-not-at-top
  _check_no_trained_base_weights(kwargs, lora, trainable)
  _check_no_expert_adapters(kwargs, read)
  tensors, adapted = {}, set()
  for rule in _linear_rules(kwargs):
    path = rule.paths[0]
    a, b = read(path + A_SUFFIX), read(path + B_SUFFIX)
    if a is None or b is None:
      continue
    out, in_ = rule.hf_shape
    module = PREFIX + rule.hf_name[:-len('.weight')]
    tensors[f'{module}.lora_A.weight'] = np.ascontiguousarray(a.reshape(in_, -1).T)
    tensors[f'{module}.lora_B.weight'] = np.ascontiguousarray(b.reshape(-1, out).T)
    adapted.add((_layer_of(rule.hf_name), rule.hf_name[:-len('.weight')]))
  if not tensors:
    raise ConfigError('the run has no LoRA adapters on the projections PEFT names '
                      f'({", ".join(MODULES)})', where='lora.targets',
                      fix='export without --adapters_only')
  config = {'peft_type': 'LORA', 'task_type': 'CAUSAL_LM', 'r': lora.rank,
            'lora_alpha': lora.alpha, 'lora_dropout': lora.dropout,
            **_targets(adapted, num_layers=int(kwargs['num_layers'])),
            'bias': 'none', 'fan_in_fan_out': False,
            'inference_mode': True, 'base_model_name_or_path': base_model}
  with durable.directory_aside(target) as partial:
    save_file(tensors, os.path.join(partial, WEIGHTS_FILE), metadata={'format': 'pt'})
    with open(os.path.join(partial, CONFIG_FILE), 'w') as f:
      json.dump(config, f, indent=2)
  modules = sorted({name.split('.')[-1] for _, name in adapted})
  return {'files': [CONFIG_FILE, WEIGHTS_FILE], 'modules': modules,
          'tensors': len(tensors), 'layers': sorted({layer for layer, _ in adapted}),
          'config': config}


def _layer_of(hf_name: str) -> int:
  return int(re.search(r'\.layers\.(\d+)\.', hf_name).group(1))


def _targets(adapted: set[tuple[int, str]], *, num_layers: int) -> dict[str, Any]:
  """PEFT's fields for the adapted (layer, module name) pairs: target_modules
  (the projections' short names), with layers_to_transform when only some
  layers have them; when the pairs are not every chosen layer times every
  chosen projection, target_modules is a regex of exactly those modules
  (PEFT fullmatches a str against each module's name)."""
  layers = sorted({layer for layer, _ in adapted})
  short = sorted({name.split('.')[-1] for _, name in adapted})
  by_pair = {(layer, name.split('.')[-1]) for layer, name in adapted}
  if by_pair != {(layer, m) for layer in layers for m in short}:
    return {'target_modules': '|'.join(re.escape(name) for _, name in sorted(adapted))}
  if len(layers) == num_layers:
    return {'target_modules': short}
  return {'target_modules': short, 'layers_to_transform': layers, 'layers_pattern': 'layers'}


def _check_no_trained_base_weights(kwargs: Mapping[str, Any], lora: LoraConfig,
                                   trainable: Sequence[str] | None) -> None:
  """ConfigError naming the base weights `train.trainable` trains beside the adapters."""
  if not trainable:
    return
  tuning = Tuning(lora=lora, trainable=tuple(trainable))
  family = hf_config.family_of(kwargs)
  rules = hf_names.tensor_rules(kwargs, family=family,
                                tied=hf_config.resolved(kwargs)['tie_embeddings'])
  trained = sorted(p for p in hf_names.variable_shapes(rules) if tuning.trains(p))
  if trained:
    raise ConfigError(
        f'train.trainable {list(trainable)!r} trains {len(trained)} base weight(s) beside the '
        f'LoRA adapters ({", ".join(trained[:6])}{" ..." if len(trained) > 6 else ""}), which '
        'PEFT adapter files do not hold: --adapters_only would drop what they learnt',
        where='--adapters_only', fix='export the whole model with the adapters merged '
                                     '(launch.export --format=hf without --adapters_only)')


def read_peft_dir(directory: str) -> tuple[LoraConfig, dict[str, np.ndarray]]:
  """(the adapters' LoraConfig, their tensors by PEFT name) of a PEFT LoRA
  directory; ConfigError naming a file or a field meshgin cannot take."""
  from safetensors import SafetensorError  # pylint: disable=g-import-not-at-top
  from safetensors.numpy import load_file  # pylint: disable=g-import-not-at-top
  path = os.path.join(directory, CONFIG_FILE)
  try:
    with open(path) as f:
      config = json.load(f)
  except (OSError, ValueError) as e:
    raise ConfigError(f'cannot read {path}: {e}', where='--peft_dir',
                      fix='give the directory PEFT saved the adapters to '
                          f'({CONFIG_FILE}, {WEIGHTS_FILE})') from None
  if not isinstance(config, dict):
    raise ConfigError(f'{path} is not a JSON object (it is a {type(config).__name__})',
                      where=path, fix='give the adapter_config.json PEFT saved')
  if config.get('peft_type', 'LORA') != 'LORA':
    raise ConfigError(f"{path}: peft_type is {config.get('peft_type')!r}", where=path,
                      fix='give LoRA adapters (peft_type LORA)')
  for field, default in _UNSUPPORTED.items():
    if config.get(field, default) not in (default, None, [], {}):
      raise ConfigError(f'{path}: {field} = {config[field]!r} is not implemented',
                        where=path, fix=f'adapters saved with {field} = {default!r}')
  modules = config.get('target_modules') or []
  if (isinstance(modules, str) or not isinstance(modules, list)
      or any(m not in MODULES for m in modules)):
    raise ConfigError(f'{path}: target_modules {modules!r}', where=path,
                      fix=f'adapters on the projections {", ".join(MODULES)}')
  layers = config.get('layers_to_transform')
  layers = [layers] if isinstance(layers, int) and not isinstance(layers, bool) else layers
  if layers is not None and (not isinstance(layers, list) or not all(
      isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in layers)
      or config.get('layers_pattern') not in (None, 'layers', ['layers'])):
    raise ConfigError(f"{path}: layers_to_transform {layers!r} (layers_pattern "
                      f"{config.get('layers_pattern')!r})", where=path,
                      fix="give layer numbers of the model's model.layers")
  within = [f'.*/block_{n:03d}/' for n in sorted(set(layers))] if layers else ['.*/']
  lora = LoraConfig(rank=_number(config, 'r', path, integer=True),
                    alpha=_number(config, 'lora_alpha', path, default=8.0),
                    dropout=_number(config, 'lora_dropout', path, default=0.0),
                    targets=tuple(f'{prefix}{MODULES[m]}' for prefix in within
                                  for m in sorted(modules)))
  weights = os.path.join(directory, WEIGHTS_FILE)
  try:
    tensors = load_file(weights)
  except (OSError, ValueError, SafetensorError) as e:
    raise ConfigError(f'cannot read {weights}: {e}', where='--peft_dir',
                      fix='save the adapters again (the file is missing, truncated or '
                          'damaged)') from None
  wrong = [f'{name} is {value.dtype}' for name, value in tensors.items()
           if value.dtype.kind != 'f' and 'float' not in value.dtype.name]
  if wrong:
    raise ConfigError(f'{weights}: {len(wrong)} tensor(s) are not floating point: '
                      f'{"; ".join(wrong[:4])}', where=weights,
                      fix='save the adapters in float32, float16 or bfloat16')
  return lora, tensors


def _number(config: Mapping[str, Any], field: str, path: str, *, integer: bool = False,
            default: float | None = None) -> float:
  """config[field] as a number (a positive int if `integer`; `default` when
  absent); ConfigError naming the field otherwise."""
  value = config.get(field, default)
  kinds = (int,) if integer else (int, float)
  if (value is None or isinstance(value, bool) or not isinstance(value, kinds)
      or (integer and value < 1) or value < 0):
    raise ConfigError(f'{path}: {field} is {value!r}' + (' (missing)' if field not in config
                                                          else ''), where=f'{path}, {field}',
                      fix=f'give adapters PEFT saved, whose {field} is a '
                          + ('positive integer (the rank)' if integer else 'number'))
  return int(value) if integer else float(value)


def meshgin_adapters(kwargs: Mapping[str, Any], tensors: Mapping[str, np.ndarray],
                     shapes: Mapping[str, tuple[int, ...]]) -> dict[str, np.ndarray]:
  """meshgin's adapter values (path -> array of `shapes[path]`) from PEFT's
  `tensors`; ConfigError for a tensor that belongs to no adapter of the model,
  or an adapter with no tensor."""
  values, used = {}, set()
  for rule in _linear_rules(kwargs):
    path = rule.paths[0]
    if path + A_SUFFIX not in shapes:
      continue
    module = PREFIX + rule.hf_name[:-len('.weight')]
    names = (f'{module}.lora_A.weight', f'{module}.lora_B.weight')
    missing = [n for n in names if n not in tensors]
    if missing:
      raise ConfigError(f'the adapters have no {missing[0]}', where='--peft_dir',
                        fix='give adapters saved for this model')
    a, b = (np.asarray(tensors[n], np.float32) for n in names)
    # PEFT's Linear adapters: lora_A.weight [r, in], lora_B.weight [out, r].
    rank, (out, in_) = shapes[path + A_SUFFIX][-1], rule.hf_shape
    for name, value, want, path_ in ((names[0], a, (rank, in_), path + A_SUFFIX),
                                     (names[1], b, (out, rank), path + B_SUFFIX)):
      if tuple(value.shape) != want:
        raise ConfigError(f'{name} is {list(value.shape)}, but PEFT\'s adapter of {path} '
                          f'({list(shapes[path_])} in meshgin) is {list(want)} at rank {rank}',
                          where='--peft_dir', fix='give adapters saved for this model, at '
                                                  'its rank (lora_A [r, in], lora_B [out, r])')
    values[path + A_SUFFIX] = np.ascontiguousarray(a.T).reshape(shapes[path + A_SUFFIX])
    values[path + B_SUFFIX] = np.ascontiguousarray(b.T).reshape(shapes[path + B_SUFFIX])
    used.update(names)
  extra = sorted(set(tensors) - used)
  if extra:
    raise ConfigError(f'{len(extra)} adapter tensor(s) fit no weight of the model: '
                      f'{", ".join(extra[:4])}', where='--peft_dir',
                      fix='give adapters saved for this model (its layers and projections)')
  return values

