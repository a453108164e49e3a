"""Hugging Face checkpoints in and out: config and name mappings, the files,
bad input, and (with the model) logits against KerasHub's own conversion.

    python -m pytest tests/test_hf_convert.py -x -q

The checkpoints are tiny random ones of each family written as transformers
writes them (tests/hf_fixtures.py, whose names and layouts are spelt out
from transformers' modeling files, not from meshgin's tables).
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from layout_core.convert import hf, hf_config, hf_files, hf_names
from layout_core.errors import ConfigError
from layout_core.infer import tokens
from tests import hf_fixtures
from tests.conftest import run_module

FAMILIES = tuple(hf_fixtures.CONFIGS)


@pytest.fixture(scope='module')
def checkpoints(tmp_path_factory) -> dict[str, tuple[str, dict[str, np.ndarray]]]:
  """family -> (directory, its tensors): each family once per module (Qwen2 in 2 shards)."""
  root = tmp_path_factory.mktemp('hf')
  return {family: (str(root / family),
                   hf_fixtures.write_checkpoint(str(root / family), family,
                                                shards=2 if family == 'qwen2' else 1))
          for family in FAMILIES}


def values_of(directory: str) -> dict[str, np.ndarray]:
  source = hf.open_hf(directory)
  return dict(source.values())


# -- config.json <-> transformer_lm --------------------------------------------------------
@pytest.mark.parametrize('family', FAMILIES)
def test_config_round_trip_keeps_every_architecture_field(family):
  config = hf_fixtures.config(family)
  kwargs, facts = hf_config.lm_kwargs_from_hf(config)
  written = hf_config.hf_config_from_lm(kwargs, tied=facts.tied, kept=config)
  again, facts_again = hf_config.lm_kwargs_from_hf(written)
  assert again == kwargs and facts_again.tied == facts.tied
  assert written['model_type'] == family  # an imported Mistral goes back as one
  shared = [k for k in config if k in written and k not in ('architectures', 'model_type',
                                                            'transformers_version')]
  differ = {k: (config[k], written[k]) for k in shared if config[k] != written[k]}
  # Qwen2's window fields are written as "no window"; the rest is the file's.
  assert set(differ) <= {'sliding_window', 'max_window_layers'}, differ
  assert config['eos_token_id'] == written['eos_token_id']


def test_config_reads_each_family_as_its_layers():
  llama, _ = hf_config.lm_kwargs_from_hf(hf_fixtures.config('llama'))
  assert (llama['norm'], llama['positions'], llama['ffn'], llama['num_kv_heads'],
          llama['head_dim'], llama['output_bias'], llama['qkv_bias']) == (
              'rms', 'rope', 'swiglu', 2, 8, False, False)
  assert llama['rope_scaling'] == {'factor': 8.0, 'low_freq_factor': 1.0,
                                   'high_freq_factor': 4.0,
                                   'original_max_position_embeddings': 16}
  qwen, facts = hf_config.lm_kwargs_from_hf(hf_fixtures.config('qwen2'))
  assert (qwen['qkv_bias'], qwen['attention_out_bias'], qwen['ffn_bias'], facts.tied) == (
      True, False, False, True)
  gpt2, facts = hf_config.lm_kwargs_from_hf(hf_fixtures.config('gpt2'))
  assert (gpt2['norm'], gpt2['positions'], gpt2['activation'], gpt2['ffn_dim'],
          gpt2['norm_epsilon'], facts.tied) == ('layer', 'learned', 'gelu_tanh', 128, 1e-5, True)
  with_bias, _ = hf_config.lm_kwargs_from_hf(hf_fixtures.config(
      'llama', attention_bias=True, mlp_bias=True, rope_scaling={'rope_type': 'default'}))
  assert (with_bias['qkv_bias'], with_bias['attention_out_bias'], with_bias['ffn_bias'],
          with_bias['rope_scaling']) == (True, True, True, None)


@pytest.mark.parametrize('kwargs, family', [
    (dict(vocab_size=64, model_dim=32, num_heads=4, ffn_dim=64, num_layers=2, max_len=32,
          norm='rms', positions='rope', ffn='swiglu', output_bias=False, qkv_bias=True,
          attention_out_bias=True, ffn_bias=True), 'llama'),
    (dict(vocab_size=64, model_dim=32, num_heads=4, num_kv_heads=1, ffn_dim=64, num_layers=2,
          max_len=32, norm='rms', positions='rope', ffn='swiglu', output_bias=False,
          qkv_bias=True), 'qwen2'),
    (dict(vocab_size=64, model_dim=32, num_heads=4, ffn_dim=64, num_layers=2, max_len=32,
          activation='gelu', output_bias=False, qkv_bias=True, attention_out_bias=True), 'gpt2'),
])
def test_kwargs_round_trip(kwargs, family):
  config = hf_config.hf_config_from_lm(kwargs, tied=False)
  assert config['model_type'] == family
  again, _ = hf_config.lm_kwargs_from_hf(config)
  assert hf_config.resolved(again) == {**hf_config.resolved(kwargs),
                                       **({'rope_theta': 10000.0} if family != 'gpt2' else {})}


@pytest.mark.parametrize('change, named', [
    (dict(output_bias=True), 'transformer_lm.output_bias is True'),
    (dict(norm='layer', positions='rope'), 'transformer_lm.positions is'),
    (dict(ffn='geglu'), "transformer_lm.ffn is 'geglu'"),
    (dict(qkv_bias=True, attention_out_bias=False, ffn_bias=True), 'attention_out_bias'),
    (dict(max_len=0), 'max_len is 0'),
])
def test_a_model_no_family_computes_has_no_config(change, named):
  kwargs = dict(vocab_size=64, model_dim=32, num_heads=4, ffn_dim=64, num_layers=2, max_len=32,
                norm='rms', positions='rope', ffn='swiglu', output_bias=False, **{})
  kwargs.update(change)
  with pytest.raises(ConfigError, match='Fix:') as raised:
    hf_config.hf_config_from_lm(kwargs, tied=False)
  assert named in str(raised.value)


# -- the tensor tables ---------------------------------------------------------------------
@pytest.mark.parametrize('family', FAMILIES)
def test_every_rule_is_undone_exactly_by_its_inverse(family, checkpoints):
  directory, tensors = checkpoints[family]
  source = hf.open_hf(directory)
  for rule in source.rules:
    original = tensors[rule.hf_name]
    converted = rule.to_meshgin(original)
    expected = [shape[1:] if rule.expert is not None else shape for shape in rule.shapes]
    assert [v.shape for v in converted] == expected  # an expert's rule: its slice
    back = rule.to_hf(converted)
    assert back.dtype == original.dtype and np.array_equal(back, original), rule.hf_name


def test_llama_tensors_land_where_the_attention_reads_them(checkpoints):
  """Against transformers' own layout: q_proj rows h*K..(h+1)*K are query
  head h; k_proj has the kv heads; o_proj's columns are the heads; Linear
  weights are [out, in]; lm_head is separate (untied)."""
  directory, t = checkpoints['llama']
  v = values_of(directory)
  heads, kv, k = 4, 2, 8
  block = 'lm/stack/block_001/'
  layer = 'model.layers.1.'
  for h in range(heads):
    np.testing.assert_array_equal(v[block + 'attn/wq'][:, h, :],
                                  t[layer + 'self_attn.q_proj.weight'][h * k:(h + 1) * k].T)
    np.testing.assert_array_equal(v[block + 'attn/wo'][h],
                                  t[layer + 'self_attn.o_proj.weight'][:, h * k:(h + 1) * k].T)
  for h in range(kv):
    np.testing.assert_array_equal(v[block + 'attn/wk'][:, h, :],
                                  t[layer + 'self_attn.k_proj.weight'][h * k:(h + 1) * k].T)
  np.testing.assert_array_equal(v[block + 'ffn/w_gate'], t[layer + 'mlp.gate_proj.weight'].T)
  np.testing.assert_array_equal(v[block + 'ffn/w_down'], t[layer + 'mlp.down_proj.weight'].T)
  np.testing.assert_array_equal(v[block + 'ln_ffn/scale'],
                                t[layer + 'post_attention_layernorm.weight'])
  np.testing.assert_array_equal(v['lm/softmax/w'], t['lm_head.weight'].T)
  assert not np.array_equal(v['lm/softmax/w'], v['lm/emb/table'].T)  # control: untied
  assert 'lm/emb/pos_table' not in v


def test_qwen2_biases_and_tied_embedding(checkpoints):
  directory, t = checkpoints['qwen2']
  v = values_of(directory)
  np.testing.assert_array_equal(v['lm/stack/block_000/attn/bk'],
                                t['model.layers.0.self_attn.k_proj.bias'].reshape(2, 8))
  assert 'lm/stack/block_000/attn/bo' not in v
  # Tied: the model's softmax reads the embedding, and has no matrix of its own.
  source = hf.open_hf(directory)
  assert source.kwargs['tie_embeddings'] is True
  assert 'lm/softmax/w' not in v
  np.testing.assert_array_equal(v['lm/emb/table'], t['model.embed_tokens.weight'])


def test_gpt2_fused_qkv_and_conv1d(checkpoints):
  """GPT-2's c_attn is [D, 3D] = q | k | v along its output, Conv1D [in, out]."""
  directory, t = checkpoints['gpt2']
  v = values_of(directory)
  d, heads, k = 32, 4, 8
  fused, bias = t['h.0.attn.c_attn.weight'], t['h.0.attn.c_attn.bias']
  for part, name in enumerate('qkv'):
    np.testing.assert_array_equal(v[f'lm/stack/block_000/attn/w{name}'],
                                  fused[:, part * d:(part + 1) * d].reshape(d, heads, k))
    np.testing.assert_array_equal(v[f'lm/stack/block_000/attn/b{name}'],
                                  bias[part * d:(part + 1) * d].reshape(heads, k))
  np.testing.assert_array_equal(v['lm/stack/block_000/attn/wo'],
                                t['h.0.attn.c_proj.weight'].reshape(heads, k, d))
  np.testing.assert_array_equal(v['lm/stack/block_000/ffn/w_in'], t['h.0.mlp.c_fc.weight'])
  np.testing.assert_array_equal(v['lm/emb/pos_table'], t['wpe.weight'])
  np.testing.assert_array_equal(v['lm/final_ln/bias'], t['ln_f.bias'])
  assert 'lm/softmax/w' not in v  # tied: GPT-2's output projection is wte


# -- files: read, write, read again ----------------------------------------------------------
@pytest.mark.parametrize('family', FAMILIES)
def test_write_then_read_gives_the_same_values_and_tensors(family, checkpoints, tmp_path):
  directory, tensors = checkpoints[family]
  source = hf.open_hf(directory)
  values, kwargs, config = dict(source.values()), source.kwargs, source.config
  target = str(tmp_path / 'out')
  written = hf.write_hf_dir(target, kwargs=kwargs, read=values.__getitem__,
                            max_shard_bytes=40_000, tokenizer_dir=directory, kept=config)
  assert written['tied'] == (family in ('qwen2', 'gpt2'))  # never trained: still equal
  assert hf_files.INDEX_FILE in written['files'] and 'tokenizer.json' in written['files']
  assert sorted(os.listdir(tmp_path)) == ['out']   # nothing left beside it
  again = values_of(target)
  assert sorted(again) == sorted(values)
  for path in values:
    assert again[path].dtype == np.float32 and np.array_equal(again[path], values[path]), path
  reader = hf_files.SafetensorsReader(target)
  prefix = 'transformer.' if family == 'gpt2' else ''
  for name, tensor in tensors.items():
    if hf_names.is_ignored(name, family):
      continue
    assert np.array_equal(reader.read(prefix + name), tensor), name


def test_an_untied_models_export_ties_equal_matrices_only(checkpoints, tmp_path):
  """A model with its own output matrix (tie_embeddings off) is written
  tied while that matrix is the embedding transposed, untied once it is not."""
  directory, _ = checkpoints['qwen2']
  source = hf.open_hf(directory)
  values, kwargs = dict(source.values()), dict(source.kwargs, tie_embeddings=False)
  for change, tied in ((0, True), (1e-3, False)):
    values['lm/softmax/w'] = values['lm/emb/table'].T + np.float32(change)
    out = str(tmp_path / f'out-{change}')
    written = hf.write_hf_dir(out, kwargs=kwargs, read=values.__getitem__)
    assert written['tied'] is tied and written['config']['tie_word_embeddings'] is tied
    again = values_of(out)
    assert ('lm/softmax/w' in again) is not tied  # read back as the model it says
    if not tied:
      np.testing.assert_array_equal(again['lm/softmax/w'], values['lm/softmax/w'])


def test_bfloat16_shards_read_one_tensor_at_a_time_exactly(tmp_path):
  tensors = hf_fixtures.write_checkpoint(str(tmp_path / 'bf16'), 'llama', dtype='bfloat16',
                                         shards=3, tokenizer=False)
  source = hf.open_hf(str(tmp_path / 'bf16'))
  assert set(source.reader.dtypes.values()) == {'BF16'}
  values = dict(source.values())
  np.testing.assert_array_equal(values['lm/stack/block_000/attn/wv'],
                                tensors['model.layers.0.self_attn.v_proj.weight'].T.reshape(
                                    32, 2, 8))
  written = hf.write_hf_dir(str(tmp_path / 'out'), kwargs=hf_config.lm_kwargs_from_hf(
      hf_fixtures.config('llama'))[0], read=values.__getitem__, dtype='bfloat16')
  assert written['config']['torch_dtype'] == 'bfloat16'
  again = values_of(str(tmp_path / 'out'))
  assert all(np.array_equal(again[p], values[p]) for p in values)  # bf16 values survive bf16


def test_the_reader_keeps_no_file_mapped_between_reads(tmp_path):
  """A mapping kept open keeps every page read so far in the process: the
  whole checkpoint by the end of an import (bench/import_hf.py)."""
  directory = str(tmp_path / 'bf16')
  hf_fixtures.write_checkpoint(directory, 'llama', dtype='bfloat16', shards=3, tokenizer=False)

  def mapped():
    with open('/proc/self/maps') as maps:
      return [line for line in maps if directory in line]
  source = hf.open_hf(directory)
  assert not mapped()
  for path, value in source.values():
    assert value.dtype == np.float32 and value.flags.c_contiguous, path
    assert not mapped(), path


# -- bad input -----------------------------------------------------------------------------
def _break_config(family, **changes):
  def make(directory):
    hf_fixtures.write_checkpoint(directory, family, cfg=hf_fixtures.config(family, **changes),
                                 tokenizer=False)
  return make


def _break_tensors(change):
  def make(directory):
    tensors = hf_fixtures.state_dict(hf_fixtures.config('llama'))
    change(tensors)
    hf_fixtures.write_checkpoint(directory, 'llama', tensors=tensors, tokenizer=False)
  return make


def _break_files(change, shards=1):
  def make(directory):
    hf_fixtures.write_checkpoint(directory, 'llama', shards=shards, tokenizer=False)
    change(directory)
  return make


def _truncate(directory):
  path = os.path.join(directory, 'model.safetensors')
  with open(path, 'r+b') as f:
    f.truncate(os.path.getsize(path) - 100)


def _to_float8(tensors):
  import ml_dtypes  # pylint: disable=g-import-not-at-top
  for name in ('model.layers.1.self_attn.q_proj.weight', 'model.layers.1.mlp.up_proj.weight'):
    tensors[name] = tensors[name].astype(ml_dtypes.float8_e4m3fn)


def _only_bin(directory):
  os.rename(os.path.join(directory, 'model.safetensors'),
            os.path.join(directory, 'pytorch_model.bin'))


BAD = {
    'unknown model_type': (_break_config('llama', model_type='falcon'),
                           ["model_type is 'falcon'", 'config.json']),
    'mistral sliding window': (_break_config('mistral', sliding_window=0),
                               ['sliding_window is 0', 'not a positive number of tokens']),
    'qwen2 sliding window': (_break_config('qwen2', use_sliding_window=True),
                             ['use_sliding_window is True']),
    'experts': (_break_config('llama', num_local_experts=8), ['num_local_experts is 8']),
    'qwen experts': (_break_config('qwen2', num_experts=4), ['num_experts is 4']),
    'rope scaling': (_break_config('llama', rope_scaling={'rope_type': 'yarn', 'factor': 4.0}),
                     ["rope_scaling is {'rope_type': 'yarn'", "'llama3'"]),
    'activation': (_break_config('llama', hidden_act='gelu'), ["hidden_act is 'gelu'"]),
    'gpt2 layer-scaled attention': (_break_config('gpt2', scale_attn_by_inverse_layer_idx=True),
                                    ['scale_attn_by_inverse_layer_idx is True']),
    'gpt2 upcast attention': (_break_config('gpt2', reorder_and_upcast_attn=True),
                              ['reorder_and_upcast_attn is True']),
    'gpt2 activation': (_break_config('gpt2', activation_function='swish'),
                        ["activation_function is 'swish'"]),
    'missing tensor': (_break_tensors(lambda t: t.pop('model.layers.1.mlp.up_proj.weight')),
                       ['1 tensor(s) missing: model.layers.1.mlp.up_proj.weight']),
    'extra tensor': (_break_tensors(lambda t: t.update({'model.layers.2.extra.weight':
                                                        np.zeros(3, np.float32)})),
                     ['model.layers.2.extra.weight']),
    'wrong shape': (_break_tensors(lambda t: t.update({'model.norm.weight':
                                                       np.ones(31, np.float32)})),
                    ['model.norm.weight is [31], config.json makes it [32]']),
    'missing shard': (_break_files(lambda d: os.remove(
        os.path.join(d, 'model-00002-of-00002.safetensors')), shards=2),
                      ['model-00002-of-00002.safetensors', 'does not exist']),
    'truncated file': (_break_files(_truncate), ['model.safetensors is not a readable']),
    'no safetensors': (_break_files(_only_bin), ['pytorch_model.bin', 'not safetensors']),
    'no config': (_break_files(lambda d: os.remove(os.path.join(d, 'config.json'))),
                  ['config.json does not exist']),
    'config not json': (_break_files(lambda d: open(os.path.join(d, 'config.json'), 'w').write(
        '{"model_type": ')), ['config.json is not JSON']),
    # Stored dtypes: only F32, F16 and BF16 widen exactly to float32.
    'integer weight': (_break_tensors(lambda t: t.update({'model.norm.weight':
                                                          np.ones(32, np.int32)})),
                       ['model.norm.weight is I32 (in model.safetensors)']),
    'bool weight': (_break_tensors(lambda t: t.update({'model.layers.0.input_layernorm.weight':
                                                       np.ones(32, bool)})),
                    ['model.layers.0.input_layernorm.weight is BOOL']),
    'float8 weights': (_break_tensors(_to_float8), ['2 tensor(s)', 'is F8_E4M3',
                                                    'model.layers.1.self_attn.q_proj.weight']),
    'quantized': (_break_config('llama', quantization_config={'quant_method': 'fp8'}),
                  ["quantization_config is set (quant_method 'fp8')"]),
}


@pytest.mark.parametrize('case', sorted(BAD))
def test_bad_checkpoint_is_a_config_error_naming_it(case, tmp_path):
  make, named = BAD[case]
  directory = str(tmp_path / 'hf')
  make(directory)
  with pytest.raises(ConfigError) as raised:
    hf.open_hf(directory)
  text = str(raised.value)
  assert 'Fix:' in text and all(part in text for part in named), text
  assert sorted(os.listdir(tmp_path)) == ['hf']


def test_the_launcher_exits_2_with_one_paragraph_and_writes_nothing(tmp_path):
  bad = str(tmp_path / 'hf')
  _break_config('llama', num_local_experts=8)(bad)
  run = str(tmp_path / 'runs' / 'llama')
  done = run_module('launch.import_hf', f'--hf_dir={bad}', f'--model_dir={run}')
  assert done.returncode == 2, done.stderr[-2000:]
  assert 'Configuration error:' in done.stderr and 'num_local_experts is 8' in done.stderr
  assert 'Traceback' not in done.stderr
  assert not os.path.exists(tmp_path / 'runs')
  os.makedirs(run)
  open(os.path.join(run, 'keep.txt'), 'w').close()
  good = str(tmp_path / 'good')
  hf_fixtures.write_checkpoint(good, 'gpt2', tokenizer=False)
  done = run_module('launch.import_hf', f'--hf_dir={good}', f'--model_dir={run}')
  assert done.returncode == 2 and 'exists and is not empty' in done.stderr, done.stderr[-2000:]
  assert os.listdir(run) == ['keep.txt']


# -- the tokenizer -------------------------------------------------------------------------
def test_a_run_with_a_tokenizer_json_decodes_text_with_it(checkpoints, tmp_path):
  from layout_core.tasks.lm import MarkovTask  # pylint: disable=g-import-not-at-top
  directory, _ = checkpoints['llama']
  run = tmp_path / 'run'
  os.makedirs(run / tokens.RUN_TOKENIZER_DIR)
  hf.copy_tokenizer(directory, str(run / tokens.RUN_TOKENIZER_DIR))
  task = MarkovTask(vocab_size=hf_fixtures.VOCAB, seq_len=8)
  tokenizer = tokens.tokenizer_for(task, run_dir=str(run))
  assert isinstance(tokenizer, tokens.HuggingFaceTokenizer) and tokenizer.of_model
  ids = tokenizer.encode('the quick brown fox')
  assert tokenizer.decode(ids) == 'the quick brown fox' and max(ids) < hf_fixtures.VOCAB
  # Its vocabulary (88) need only fit the model's (96), not equal the task's.
  tokens.check_vocabulary(tokenizer, model_vocab=hf_fixtures.VOCAB, task_vocab=hf_fixtures.VOCAB)
  with pytest.raises(ConfigError, match='has 88 ids, but the model has 64'):
    tokens.check_vocabulary(tokenizer, model_vocab=64, task_vocab=None)
  assert isinstance(tokens.tokenizer_for(task, run_dir=str(tmp_path)), tokens.IdTokenizer)


def test_a_run_with_a_sentencepiece_model_decodes_text_with_it(tmp_path):
  import sentencepiece  # pylint: disable=g-import-not-at-top
  directory = tmp_path / 'run' / tokens.RUN_TOKENIZER_DIR
  os.makedirs(directory)
  sentencepiece.SentencePieceTrainer.train(
      sentence_iterator=iter([' '.join(hf_fixtures.WORDS)] * 8),
      model_prefix=str(directory / 'tokenizer'), vocab_size=40, minloglevel=2)
  tokenizer = tokens.run_tokenizer(str(tmp_path / 'run'))
  assert isinstance(tokenizer, tokens.SentencePieceTokenizer) and tokenizer.of_model
  assert tokenizer.decode(tokenizer.encode('the lazy dog')) == 'the lazy dog'


def test_help_explains_the_import():
  done = run_module('launch.import_hf', '--help')  # absl's help exits 1
  for text in ('--hf_dir', '--model_dir', '--overwrite', '--gin_file', '--gin_bindings',
               'model.safetensors.index.json', 'Exit status'):
    assert text in done.stdout, text


@pytest.mark.parametrize('num_layers', [1, 2])
@pytest.mark.parametrize('family', FAMILIES)
def test_the_tables_name_the_models_own_variables(family, num_layers):
  """Every variable of transformer_lm, and nothing else, has a tensor, with
  its shape: also for one layer, whose block the model names 'block', not
  'block_000' (a 1-layer import failed with 'variables only in the model')."""
  kwargs, facts = hf_config.lm_kwargs_from_hf(
      dict(hf_fixtures.config(family), **{'n_layer' if family == 'gpt2' else
                                           'num_hidden_layers': num_layers}))
  params = hf_config.lm_params(kwargs)
  model = {s.path: tuple(s.shape) for s in params.cls.variable_specs(params)}
  rules = hf_names.tensor_rules(kwargs, family=family, tied=facts.tied)
  assert hf_names.variable_shapes(rules) == model
