"""LoRA adapters in PEFT's files, read and written without a model (no TensorFlow).

    python -m pytest tests/test_peft_files.py -x -q

The adapters are written here as PEFT writes them for the tiny Llama of
tests/hf_fixtures.py (`lora_A.weight` [r, in], `lora_B.weight` [out, r] of
each nn.Linear, under `base_model.model.`), with meshgin's adapter shapes
(A [in..., r], B [r, out...]) spelt out from the weights' shapes, not from
`layout_core.convert.peft`. Each malformed directory must be a ConfigError
naming what is wrong (launchers turn it into exit 2 and one paragraph).
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from layout_core.convert import hf_config, peft
from layout_core.errors import ConfigError
from layout_core.model.lora import LoraConfig
from tests import hf_fixtures

RANK = 4
KWARGS = hf_config.lm_kwargs_from_hf(hf_fixtures.config('llama'))[0]
# PEFT module -> (its nn.Linear's [out, in], meshgin's weight dims that meet the input).
LINEAR = {'q_proj': ((32, 32), 'attn/wq', (32,), (4, 8)),
          'v_proj': ((16, 32), 'attn/wv', (32,), (2, 8))}
SHAPES = {f'lm/stack/block_{layer:03d}/{path}{suffix}': shape
          for layer in range(2) for _, path, ins, outs in LINEAR.values()
          for suffix, shape in (('_lora_a', ins + (RANK,)), ('_lora_b', (RANK,) + outs))}


def peft_tensors(seed: int = 0) -> dict[str, np.ndarray]:
  rng = np.random.default_rng(seed)
  tensors = {}
  for layer in range(2):
    for module, ((out, in_), _, _, _) in LINEAR.items():
      name = f'base_model.model.model.layers.{layer}.self_attn.{module}'
      tensors[f'{name}.lora_A.weight'] = rng.normal(size=(RANK, in_)).astype(np.float32)
      tensors[f'{name}.lora_B.weight'] = rng.normal(size=(out, RANK)).astype(np.float32)
  return tensors


def write_peft(directory: str, *, config=None, tensors=None, **changes) -> None:
  """An adapter directory as PEFT's save_pretrained writes it, with `changes` to its config."""
  from safetensors.numpy import save_file  # pylint: disable=g-import-not-at-top
  os.makedirs(directory)
  if config is None:
    config = {'peft_type': 'LORA', 'task_type': 'CAUSAL_LM', 'r': RANK, 'lora_alpha': 8,
              'lora_dropout': 0.0, 'target_modules': ['q_proj', 'v_proj'], 'bias': 'none',
              'base_model_name_or_path': 'downloads/llama', **changes}
    config = {k: v for k, v in config.items() if v is not ...}
  with open(os.path.join(directory, peft.CONFIG_FILE), 'w') as f:
    json.dump(config, f)
  save_file(peft_tensors() if tensors is None else tensors,
            os.path.join(directory, peft.WEIGHTS_FILE), metadata={'format': 'pt'})


def test_well_formed_adapters_read_as_the_transposed_matrices(tmp_path):
  write_peft(str(tmp_path / 'a'))
  lora, tensors = peft.read_peft_dir(str(tmp_path / 'a'))
  assert (lora.rank, lora.alpha, lora.targets) == (RANK, 8.0, ('.*/attn/wq', '.*/attn/wv'))
  values = peft.meshgin_adapters(KWARGS, tensors, SHAPES)
  reference = peft_tensors()
  name = 'base_model.model.model.layers.1.self_attn.v_proj'
  np.testing.assert_array_equal(values['lm/stack/block_001/attn/wv_lora_a'],
                                reference[f'{name}.lora_A.weight'].T)
  np.testing.assert_array_equal(values['lm/stack/block_001/attn/wv_lora_b'],
                                reference[f'{name}.lora_B.weight'].T.reshape(RANK, 2, 8))


def _transposed(which: str):
  tensors = peft_tensors()
  name = f'base_model.model.model.layers.0.self_attn.q_proj.lora_{which}.weight'
  tensors[name] = np.ascontiguousarray(tensors[name].T)  # [32, 4] <-> [4, 32]: equal sizes
  return tensors


def _truncated(directory: str) -> None:
  path = os.path.join(directory, peft.WEIGHTS_FILE)
  with open(path, 'r+b') as f:
    f.truncate(os.path.getsize(path) - 64)


BAD_PEFT = {
    'config not an object': (dict(config=[1, 2]), ['is not a JSON object (it is a list)']),
    'no r': (dict(r=...), ["r is None (missing)"]),
    'r zero': (dict(r=0), ['r is 0']),
    'r text': (dict(r='4'), ["r is '4'"]),
    'lora_alpha null': (dict(lora_alpha=None), ['lora_alpha is None']),
    'lora_dropout text': (dict(lora_dropout='0.1'), ["lora_dropout is '0.1'"]),
    'target_modules not a list': (dict(target_modules=7), ['target_modules 7']),
    'transposed A': (dict(tensors=_transposed('A')),
                     ['layers.0.self_attn.q_proj.lora_A.weight is [32, 4]', '[4, 32]']),
    'transposed B': (dict(tensors=_transposed('B')),
                     ['layers.0.self_attn.q_proj.lora_B.weight is [4, 32]', '[32, 4]']),
    'another rank': (dict(tensors=peft_tensors() | {
        'base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight':
            np.zeros((16, 2), np.float32)}), ['v_proj.lora_B.weight is [16, 2]']),
    'integer tensors': (dict(tensors={k: v.astype(np.int32) for k, v in peft_tensors().items()}),
                        ['not floating point', 'is int32']),
}


@pytest.mark.parametrize('case', sorted(BAD_PEFT) + ['truncated file', 'no weights file'])
def test_a_malformed_peft_directory_is_a_config_error_naming_it(case, tmp_path):
  directory = str(tmp_path / 'adapters')
  if case in BAD_PEFT:
    write_peft(directory, **BAD_PEFT[case][0])
    named = BAD_PEFT[case][1]
  else:
    write_peft(directory)
    if case == 'truncated file':
      _truncated(directory)
    else:
      os.remove(os.path.join(directory, peft.WEIGHTS_FILE))
    named = [f'cannot read {os.path.join(directory, peft.WEIGHTS_FILE)}']
  with pytest.raises(ConfigError) as raised:
    _, tensors = peft.read_peft_dir(directory)
    peft.meshgin_adapters(KWARGS, tensors, SHAPES)
  text = str(raised.value)
  assert 'Fix:' in text and all(part in text for part in named), text
  assert '\n' not in text.strip(), text  # one paragraph


# -- writing -------------------------------------------------------------------------------
def meshgin_values(layers, modules=('q_proj', 'v_proj')) -> dict[str, np.ndarray]:
  """The run's adapter values (path -> array) on `modules` of `layers` only."""
  rng = np.random.default_rng(1)
  return {f'lm/stack/block_{layer:03d}/{LINEAR[m][1]}{suffix}':
          rng.normal(size=SHAPES[f'lm/stack/block_000/{LINEAR[m][1]}{suffix}']).astype(np.float32)
          for layer in layers for m in modules for suffix in ('_lora_a', '_lora_b')}


def written(directory: str) -> tuple[dict, list[str]]:
  """(adapter_config.json, the modules its safetensors file holds), read back with
  json and safetensors."""
  from safetensors import safe_open  # pylint: disable=g-import-not-at-top
  with open(os.path.join(directory, peft.CONFIG_FILE)) as f:
    config = json.load(f)
  with safe_open(os.path.join(directory, peft.WEIGHTS_FILE), 'numpy') as f:
    names = sorted({k[len('base_model.model.'):].rsplit('.lora_', 1)[0] for k in f.keys()})
  return config, names


LORA = LoraConfig(rank=RANK, alpha=8.0, targets=('.*/attn/w[qv]',))


def test_adapters_on_some_layers_say_which_in_layers_to_transform(tmp_path):
  """Adapters on block 1 only: PEFT must be told (layers_to_transform), else
  target_modules alone would adapt every layer's q and v. Read back, they
  adapt block 1 alone, with the values written."""
  values = meshgin_values([1])
  directory = str(tmp_path / 'a')
  peft.write_peft_dir(directory, kwargs=KWARGS, lora=LORA, read=values.get)
  config, modules = written(directory)
  assert modules == ['model.layers.1.self_attn.q_proj', 'model.layers.1.self_attn.v_proj']
  assert config['target_modules'] == ['q_proj', 'v_proj']
  assert config['layers_to_transform'] == [1] and config['layers_pattern'] == 'layers'
  lora, tensors = peft.read_peft_dir(directory)
  assert [p for p in SHAPES if lora.adapts(p[:-len('_lora_a')]) and p.endswith('_a')] == [
      'lm/stack/block_001/attn/wq_lora_a', 'lm/stack/block_001/attn/wv_lora_a']
  again = peft.meshgin_adapters(KWARGS, tensors, {p: SHAPES[p] for p in values})
  for path, value in values.items():
    np.testing.assert_array_equal(again[path], value, err_msg=path)
  # Control: on every layer, no layers_to_transform.
  peft.write_peft_dir(str(tmp_path / 'b'), kwargs=KWARGS, lora=LORA,
                      read=meshgin_values([0, 1]).get)
  assert 'layers_to_transform' not in written(str(tmp_path / 'b'))[0]


def test_adapters_on_no_grid_of_layers_and_modules_name_each_module(tmp_path):
  values = {**meshgin_values([0], ['q_proj']), **meshgin_values([1], ['v_proj'])}
  directory = str(tmp_path / 'a')
  peft.write_peft_dir(directory, kwargs=KWARGS, lora=LORA, read=values.get)
  config, modules = written(directory)
  assert modules == ['model.layers.0.self_attn.q_proj', 'model.layers.1.self_attn.v_proj']
  everyone = [f'model.layers.{n}.self_attn.{m}' for n in range(2) for m in LINEAR]
  import re  # pylint: disable=g-import-not-at-top
  assert [m for m in everyone if re.fullmatch(config['target_modules'], m)] == modules


def test_base_weights_trained_beside_the_adapters_are_named_not_dropped(tmp_path):
  with pytest.raises(ConfigError) as raised:
    peft.write_peft_dir(str(tmp_path / 'a'), kwargs=KWARGS, lora=LORA,
                        read=meshgin_values([0, 1]).get,
                        trainable=('.*/final_ln/.*', '.*block_001/ln_ffn/.*'))
  text = str(raised.value)
  assert 'lm/final_ln/scale' in text and 'lm/stack/block_001/ln_ffn/scale' in text, text
  assert 'without --adapters_only' in text and not os.path.exists(tmp_path / 'a')
  peft.write_peft_dir(str(tmp_path / 'b'), kwargs=KWARGS, lora=LORA,
                      read=meshgin_values([0, 1]).get, trainable=())  # adapters only: fine
