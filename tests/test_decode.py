"""Decoding with a KV cache (`layout_core.infer.decode`), against independent references.

The references: the model's own forward pass (a built layer's `fprop`, not
the decoder's code), decoding by running the whole window again at every
step (`generate_by_recomputing`), each prompt decoded alone, and the same
model on one device without DTensor. The weights are random with a wide
spread (not the init's 0.02), so the logits are far from ties and a token
that differs means a real difference. The launcher and train.sample_every
are checked on a real quickstart run (slow).
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.experimental import dtensor

from layout_core.checkpoint.shard_io import assign_global
from layout_core.errors import ConfigError
from layout_core.infer.decode import DONE, CachedLM, lm_layers
from layout_core.infer.sampling import Sampling
from layout_core.layout.mesh import pack_global_array
from layout_core.layout.rules import LayoutRules
from layout_core.layout.variables import to_numpy
from layout_core.model.built import build_params_model
from layout_core.model.layers import FeedForward
from layout_core.model.lm import transformer_lm_params
from tests.conftest import TWO_DEVICES, read_events, run_module
from tests.numerics import assert_close

PARAMS = transformer_lm_params(vocab_size=32, model_dim=32, num_heads=4, ffn_dim=64,
                               num_layers=2, max_len=24)
MEGATRON = LayoutRules([
    (r'.*/attn/w[qkv]', ('unsharded', 'model', 'unsharded')),
    (r'.*/attn/wo', ('model', 'unsharded', 'unsharded')),
    (r'.*/ffn/w_in', ('unsharded', 'model')), (r'.*/ffn/b_in', ('model',)),
    (r'.*/ffn/w_out', ('model', 'unsharded')),
    (r'.*/emb/(pos_)?table', ('unsharded', 'model')),
    (r'.*/softmax/w', ('unsharded', 'model')), (r'.*/softmax/b', ('model',))])
# Logits of one forward pass computed another way (the decoder, a mesh), relative
# to their scale (tests/numerics.py). measured: 1.4e-06 / 1.4e-06 / 1.4e-06
# (default / no oneDNN / 1 thread) on the 2x4 mesh, 0 on one device.
LOGITS = 2e-5
# Three prompts of different lengths, right-padded with 0.
PROMPTS = np.array([[3, 1, 4, 1, 5, 9], [2, 7, 1, 0, 0, 0], [8, 0, 0, 0, 0, 0]], np.int32)
LENGTHS = np.array([6, 3, 1], np.int32)
SAMPLED = Sampling(temperature=1.0)


def random_values(seed: int = 0) -> dict[str, np.ndarray]:
  rng = np.random.default_rng(seed)
  values = {}
  for spec in PARAMS.cls.variable_specs(PARAMS):
    name = spec.path.rsplit('/', 1)[1]
    if name == 'scale':
      value = 1 + 0.1 * rng.standard_normal(spec.shape)
    elif name.startswith('b') or name == 'bias':
      value = 0.1 * rng.standard_normal(spec.shape)
    else:
      value = 0.5 * rng.standard_normal(spec.shape)
    values[spec.path] = value.astype(np.float32)
  return values


@pytest.fixture(scope='module')
def values():
  return random_values()


@pytest.fixture(scope='module')
def plain(values):
  """One device, no DTensor: plain variables."""
  return CachedLM(PARAMS, {path: tf.Variable(v) for path, v in values.items()})


def on_mesh(mesh, rules, values) -> tuple[CachedLM, object]:
  built = build_params_model(PARAMS, mesh=mesh, rules=rules, seed=0)
  for path, variable in built.variables.items():
    assign_global(variable, values[path])
  return CachedLM(PARAMS, built.variables, batch_axis='data'), built


@pytest.fixture(scope='module')
def megatron(mesh_2x4, values):
  return on_mesh(mesh_2x4, MEGATRON, values)


@pytest.fixture(scope='module')
def data8(mesh_data8, values):
  return on_mesh(mesh_data8, LayoutRules([]), values)[0]


def generate(lm, prompts=PROMPTS, lengths=LENGTHS, *, cached=True, **settings):
  settings.setdefault('max_new_tokens', 10)
  run = lm.generate if cached else lm.generate_by_recomputing
  return to_numpy(run(prompts, lengths, **settings))


# -- the forward pass -----------------------------------------------------------------
def test_logits_equal_the_models_own_forward_pass(values, plain):
  tokens = np.random.default_rng(1).integers(0, 32, [3, 12]).astype(np.int32)
  reference = _forward(values, tokens)
  got = to_numpy(plain.logits(tokens))
  assert got.shape == (3, 12, 32)
  assert_close(got, reference, rel=LOGITS, what='logits')
  assert np.abs(reference).max() > 1  # a positive control: logits far from all-equal


def _forward(values, tokens) -> np.ndarray:
  """The model's own forward pass: the built layers' fprop on plain variables,
  compiled as the decoder's is (eager kernels round differently)."""
  model = PARAMS.Instantiate()
  for path, variable in _paths(model).items():
    variable.assign(values[path])
  return tf.function(model)(tf.constant(tokens)).numpy()


def _paths(layer, found=None) -> dict:
  found = {} if found is None else found
  for name in layer.variable_names:
    found[f'{layer.path}/{name}'] = getattr(layer, name)
  for child in layer.children():
    _paths(child, found)
  return found


def test_logits_on_the_2x4_mesh_equal_one_devices(values, megatron, mesh_2x4):
  lm, built = megatron
  tokens = np.random.default_rng(2).integers(0, 32, [4, 12]).astype(np.int32)
  reference = _forward(values, tokens)
  assert_close(to_numpy(lm.logits(tokens)), reference, rel=LOGITS, what='decoder logits')
  # and the mesh model's own forward pass, for the same numbers
  packed = pack_global_array(tokens, dtensor.Layout(['data', 'unsharded'], mesh_2x4))
  own = to_numpy(tf.function(lambda t: built.call((t,), False))(packed))
  assert_close(own, reference, rel=LOGITS, what='model logits')


# -- greedy: the cache against recomputing, rows against prompts alone ------------------
def test_greedy_with_the_cache_equals_recomputing_on_one_device(plain):
  cached, recomputed = generate(plain), generate(plain, cached=False)
  np.testing.assert_array_equal(cached, recomputed)
  assert len(set(cached.ravel())) > 3  # not a constant stream


def test_each_row_equals_its_prompt_decoded_alone(plain):
  for sampling in (Sampling(), SAMPLED):
    together = generate(plain, sampling=sampling, seed=5)
    for row, length in enumerate(LENGTHS):
      alone = generate(plain, PROMPTS[row:row + 1, :length], LENGTHS[row:row + 1],
                       sampling=sampling, seed=5, first_row=row)
      np.testing.assert_array_equal(together[row:row + 1], alone)


def test_greedy_on_the_2x4_megatron_mesh_equals_one_device(plain, megatron):
  lm = megatron[0]
  assert (lm.batch_axis, lm.head_axis) == ('data', 'model')
  reference = generate(plain)
  np.testing.assert_array_equal(generate(lm), reference)
  np.testing.assert_array_equal(generate(lm, cached=False), reference)


def test_the_cache_is_split_over_heads_and_batch_on_the_mesh(megatron, mesh_2x4):
  lm = megatron[0]
  prompts = pack_global_array(PROMPTS[[0, 1, 2, 0], :4],
                              dtensor.Layout(['data', 'unsharded'], mesh_2x4))
  lengths = pack_global_array(np.array([4, 3, 1, 2], np.int32),
                              dtensor.Layout(['data'], mesh_2x4))
  caches, _ = tf.function(lambda p, n: lm.prefill(p, n, max_new_tokens=5))(prompts, lengths)
  keys = caches[0][0]
  assert keys.shape == (4, 8, 4, 8)  # [B, P + new - 1, heads, head_dim]
  assert dtensor.fetch_layout(keys).sharding_specs == ['data', 'unsharded', 'model',
                                                       'unsharded']


# -- sampling ---------------------------------------------------------------------------
def test_the_same_seed_gives_the_same_samples_on_any_mesh(plain, data8, megatron):
  one = generate(plain, sampling=SAMPLED, seed=11)
  np.testing.assert_array_equal(generate(data8, sampling=SAMPLED, seed=11), one)
  np.testing.assert_array_equal(generate(megatron[0], sampling=SAMPLED, seed=11), one)
  assert not np.array_equal(generate(plain, sampling=SAMPLED, seed=12), one)  # control


def test_sampling_settings_behave(plain):
  greedy = generate(plain)
  np.testing.assert_array_equal(generate(plain, sampling=Sampling(temperature=1.0, top_k=1),
                                         seed=3), greedy)
  np.testing.assert_array_equal(generate(plain, sampling=Sampling(temperature=1.0, top_p=1e-4),
                                         seed=3), greedy)
  assert any(not np.array_equal(generate(plain, sampling=SAMPLED, seed=s), greedy)
             for s in range(3))
  top2 = Sampling(temperature=1.0, top_k=2)
  logits = to_numpy(plain.logits(PROMPTS[:1, :6]))[0, -1]
  firsts = {int(generate(plain, PROMPTS[:1], LENGTHS[:1], sampling=top2, seed=s,
                         max_new_tokens=1)[0, 0]) for s in range(12)}
  assert firsts <= set(np.argsort(logits)[-2:].tolist()) and len(firsts) == 2


@pytest.mark.parametrize('settings', [dict(temperature=-1.0), dict(top_k=-2), dict(top_p=0.0),
                                      dict(top_p=1.5), dict(temperature=float('nan'))])
def test_bad_sampling_settings_are_config_errors(settings):
  with pytest.raises(ConfigError, match=list(settings)[0]):
    Sampling(**settings)


def test_a_row_stops_at_a_stop_id(plain):
  greedy = generate(plain)
  stop = int(greedy[0, 2])
  out = generate(plain, stop_ids=[stop])
  for row in range(len(PROMPTS)):
    hits = np.flatnonzero(greedy[row] == stop)
    end = hits[0] + 1 if hits.size else greedy.shape[1]
    np.testing.assert_array_equal(out[row, :end], greedy[row, :end])
    assert (out[row, end:] == DONE).all()


def test_generate_traces_into_one_function_without_dtensor(plain):
  function = tf.function(lambda p, n, s: plain.generate(p, n, max_new_tokens=10,
                                                        sampling=SAMPLED, seed=s))
  traced = function.get_concrete_function(tf.TensorSpec([3, 6], tf.int32),
                                          tf.TensorSpec([3], tf.int32),
                                          tf.TensorSpec([], tf.int64))
  ops = {op.type for op in traced.graph.get_operations()}
  assert 'While' in ops or 'StatelessWhile' in ops
  assert not any('DTensor' in op or 'Relayout' in op for op in ops)
  np.testing.assert_array_equal(function(PROMPTS, LENGTHS, tf.constant(4, tf.int64)).numpy(),
                                generate(plain, sampling=SAMPLED, seed=4))


# -- what is refused --------------------------------------------------------------------
def test_too_long_a_prompt_is_a_config_error(plain):
  prompts = np.zeros([1, 20], np.int32)
  with pytest.raises(ConfigError, match='max_len = 24'):
    plain.generate(prompts, [20], max_new_tokens=6)
  plain.generate(prompts, [20], max_new_tokens=5)  # 20 + 5 - 1 = 24 positions: fits


def test_other_models_and_weights_are_config_errors(values):
  with pytest.raises(ConfigError, match='not a Transformer LM'):
    lm_layers(FeedForward.Params())
  with pytest.raises(ConfigError, match='not a Params tree'):
    lm_layers(object())
  wrong = dict(values)
  del wrong['lm/final_ln/scale']
  with pytest.raises(ConfigError, match='1 missing'):
    CachedLM(PARAMS, wrong)


def test_tokenizers_of_each_task(tmp_path):
  from layout_core.infer import tokens  # pylint: disable=g-import-not-at-top
  from layout_core.tasks.lm import MarkovTask, TextFileTask  # pylint: disable=g-import-not-at-top
  text = tmp_path / 'text.txt'
  text.write_text('héllo wörld\n' * 40)
  byte = tokens.tokenizer_for(TextFileTask(path=str(text), seq_len=8))
  assert byte.decode(byte.encode('héllo\n')) == 'héllo\n' and len(byte.encode('é')) == 2
  ids = tokens.tokenizer_for(MarkovTask(vocab_size=8, seq_len=4))
  assert ids.decode([3, 1]) == '3 1' and not ids.has_text
  with pytest.raises(ConfigError, match='has no text'):
    ids.encode('hello')
  assert tokens.corpus_spm_model(str(tmp_path / 'train-*.tfrecord')) is None
  (tmp_path / 'spm.model').write_bytes(b'')
  assert tokens.corpus_spm_model(str(tmp_path / 'train-*.tfrecord')) == str(tmp_path / 'spm.model')
  with pytest.raises(ConfigError, match='not the model.s tokenizer'):
    tokens.check_vocabulary(byte, model_vocab=64, task_vocab=64)
  tokens.check_vocabulary(byte, model_vocab=256, task_vocab=256)


def test_an_output_path_that_cannot_be_written_is_a_config_error(tmp_path):
  from layout_core.durable import check_writable, write_atomically
  a_file = tmp_path / 'a_file'
  a_file.write_text('x')
  for path, said in ((a_file / 'x.jsonl', 'is a file, not a directory'),
                     (a_file / 'deeper' / 'x.jsonl', 'is a file, not a directory'),
                     (tmp_path, 'is a directory')):
    with pytest.raises(ConfigError, match=said):
      check_writable(str(path), where='--output')
    with pytest.raises(OSError):  # control: writing there really fails
      write_atomically(str(path), b'{}')
  fresh = tmp_path / 'new' / 'dirs' / 'out.jsonl'
  check_writable(str(fresh), where='--output')
  write_atomically(str(fresh), b'{}')
  assert fresh.read_text() == '{}'


def test_sample_every_is_refused_where_it_cannot_run(classifier_data):
  from plugins import gin_setup, plan  # pylint: disable=g-import-not-at-top
  for files, data, refused in (
      (['configs/experiments/lm_pipeline.gin'], [], 'pipelined'),
      (['configs/experiments/classifier_tfrecord.gin'], classifier_data, 'Transformer LM')):
    with pytest.raises(ConfigError, match=f'train.sample_every.*{refused}'):
      with gin_setup.parsed_config(files=files, bindings=[*data, 'train.sample_every = 5'],
                                   search_paths=[]):
        plan.make_plan()
  with pytest.raises(ConfigError, match='train.sample_tokens'):
    with gin_setup.parsed_config(files=['configs/experiments/quickstart.gin'],
                                 bindings=['train.sample_every = 5',
                                           'train.sample_tokens = 40'], search_paths=[]):
      plan.make_plan()


# -- the launcher and train.sample_every on a real run (slow) ----------------------------
@pytest.fixture(scope='module')
def quick_run(tmp_path_factory):
  model_dir = str(tmp_path_factory.mktemp('decode') / 'run')
  done = run_module('launch.train', '--gin_file=configs/experiments/quickstart.gin', TWO_DEVICES,
                    f'--model_dir={model_dir}', '--gin_bindings=train.num_steps = 8',
                    '--gin_bindings=train.eval_every = 0', '--gin_bindings=train.log_every = 4',
                    '--gin_bindings=train.sample_every = 4',
                    '--gin_bindings=train.sample_tokens = 6')
  assert done.returncode == 0, done.stderr[-3000:]
  return model_dir


def test_sample_every_writes_text_samples(quick_run):
  texts = read_events(quick_run)['text']['samples/text']
  assert len(texts) == 2  # steps 4 and 8
  rows = [line for line in texts[-1].splitlines() if line.startswith('| ') and '#' not in line]
  assert len(rows) == 4 and all(len(row.split('|')[3].split()) == 6 for row in rows)


def test_decode_writes_jsonl_and_refuses_bad_input(quick_run, tmp_path):
  output = str(tmp_path / 'out.jsonl')
  done = run_module('launch.decode', f'--model_dir={quick_run}', '--prompt_ids=1,2,3',
                    '--prompt_ids=5', '--max_new_tokens=7', f'--output={output}')
  assert done.returncode == 0, done.stderr[-3000:]
  records = [json.loads(line) for line in open(output)]
  assert [r['ids'] for r in records] == [[1, 2, 3], [5]]
  assert all(len(r['continuation']) == 7 and r['text'] == ' '.join(map(str, r['continuation']))
             for r in records)
  assert '[0] 1,2,3' in done.stdout
  empty = str(tmp_path / 'empty')
  os.makedirs(empty)
  for args, said in (([f'--model_dir={empty}', '--prompt_ids=1'], 'no checkpoint'),
                     ([f'--model_dir={quick_run}', '--prompt_ids=1',
                       '--gin_bindings=transformer_lm.model_dim = 32'], 'does not match'),
                     ([f'--model_dir={quick_run}', '--prompt_ids=' + ','.join(['1'] * 60)],
                      'max_len = 64'),
                     ([f'--model_dir={quick_run}', '--prompt=hello'], 'has no text'),
                     ([f'--model_dir={quick_run}', '--prompt_ids=1',
                       f'--output={output}/x.jsonl'], '--output')):
    bad = run_module('launch.decode', *args)
    assert bad.returncode == 2, (args, bad.stderr[-2000:])
    assert said in bad.stderr and 'Traceback' not in bad.stderr


# -- stops: sequences, special tokens' text, a chat's defaults --------------------------
def test_a_row_stops_where_its_new_tokens_end_with_a_stop_sequence(plain, megatron):
  greedy = generate(plain, max_new_tokens=12)
  sequence = [int(t) for t in greedy[1, 3:5]]  # a pair row 1 draws
  out = generate(plain, max_new_tokens=12, stop_sequences=[sequence])
  recomputed = generate(plain, max_new_tokens=12, stop_sequences=[sequence], cached=False)
  np.testing.assert_array_equal(out, recomputed)
  np.testing.assert_array_equal(generate(megatron[0], max_new_tokens=12,
                                         stop_sequences=[sequence]), out)  # step by step
  for row in range(len(PROMPTS)):  # by hand: the first end of the pair in the row's new tokens
    new = greedy[row].tolist()
    ends = [i + 2 for i in range(len(new) - 1) if new[i:i + 2] == sequence]
    end = ends[0] if ends else len(new)
    np.testing.assert_array_equal(out[row, :end], greedy[row, :end])
    assert (out[row, end:] == DONE).all()
  assert (out[1] == DONE).sum() > 0  # a positive control: row 1 did stop
  # The prompt's tokens do not count: a sequence that starts in the prompt never matches.
  tail = [int(PROMPTS[0, LENGTHS[0] - 1]), int(greedy[0, 0])]
  unmatched = generate(plain, max_new_tokens=12, stop_sequences=[tail])
  first_in_new = [i + 2 for i in range(11) if greedy[0, i:i + 2].tolist() == tail]
  assert (unmatched[0] != DONE).sum() == (first_in_new[0] if first_in_new else 12)
  with pytest.raises(ConfigError, match='stop sequence is empty'):
    plain.generate(PROMPTS, LENGTHS, max_new_tokens=2, stop_sequences=[[]])
  with pytest.raises(ConfigError, match=r'stop ids \[32\]'):
    plain.generate(PROMPTS, LENGTHS, max_new_tokens=2, stop_sequences=[[1, 32]])


def test_stop_flags_and_a_chats_default_stops(tmp_path):
  """--stop's values and --chat's defaults (`layout_core.infer.stops`), on a
  Llama 3-like tokenizer whose `encode` adds a BOS (its ids written out by
  tests/test_instruct.py's fixture)."""
  from layout_core.infer import stops  # pylint: disable=g-import-not-at-top
  from layout_core.tasks import chat  # pylint: disable=g-import-not-at-top
  from layout_core.tasks.instruct import find_tokenizer  # pylint: disable=g-import-not-at-top
  from tests.test_instruct import LLAMA_LIKE, hf_tokenizer_dir  # pylint: disable=g-import-not-at-top
  directory, ids = hf_tokenizer_dir(tmp_path, LLAMA_LIKE)
  tokenizer, _ = find_tokenizer(directory)
  assert len(tokenizer.encode('<|eot_id|>')) == 2  # BOS + the token: what --stop refused
  eot = ids['<|eot_id|>']
  assert stops.parse_stops(['<|eot_id|>', '5', '7,8', 'red blue', 'red'], tokenizer) == (
      [eot, 5, ids['red']], [[7, 8], [ids['red'], ids['blue']]])
  assert stops.parse_stops(['<|eot_id|>'], tokenizer)[0] == [eot]
  template = chat.find_template(directory)
  assert stops.chat_stops(tokenizer, template=template, directory=directory) == ([eot], [])
  with open(os.path.join(directory, 'generation_config.json'), 'w') as f:
    json.dump({'eos_token_id': [eot, ids['please']]}, f)
  assert stops.chat_stops(tokenizer, template=template, directory=directory) == (
      [eot, ids['please']], [])
  # the default template's <|end|> is several bytes: a stop sequence
  byte = chat.end_of_turn_ids(chat.DefaultTemplate(), find_tokenizer('bytes')[0])
  assert byte == list(b'<|end|>')
  assert stops.chat_stops(find_tokenizer('bytes')[0], template=chat.DefaultTemplate(),
                          directory=None) == ([], [list(b'<|end|>')])


def test_decode_chat_stops_at_the_runs_eos_by_default(quick_run, tmp_path):
  """--chat on a run given a tokenizer/ (a copy of the quickstart run): its
  generation_config.json names every id an EOS, so each reply is one token;
  without --chat the same prompt runs to --max_new_tokens, and --stop with a
  special token's text is its id."""
  import shutil  # pylint: disable=g-import-not-at-top
  from tests.test_instruct import LLAMA_LIKE, hf_tokenizer_dir  # pylint: disable=g-import-not-at-top
  run = str(tmp_path / 'run')
  shutil.copytree(quick_run, run)
  directory, ids = hf_tokenizer_dir(tmp_path, LLAMA_LIKE)
  shutil.copytree(directory, os.path.join(run, 'tokenizer'))
  with open(os.path.join(run, 'tokenizer', 'generation_config.json'), 'w') as f:
    json.dump({'eos_token_id': list(range(64))}, f)
  output = str(tmp_path / 'out.jsonl')
  done = run_module('launch.decode', f'--model_dir={run}', '--chat', '--prompt=name a colour',
                    '--max_new_tokens=6', f'--output={output}')
  assert done.returncode == 0, done.stderr[-3000:]
  record = json.loads(open(output).read())
  assert record['ids'][:2] == [ids['<|begin_of_text|>'], ids['<|start_header_id|>']]
  assert len(record['continuation']) == 1
  plain_run = run_module('launch.decode', f'--model_dir={run}', '--prompt_ids=' + ','.join(
      map(str, record['ids'])), '--max_new_tokens=6', '--stop=<|eot_id|>', '--stop=1,2',
                         f'--output={output}')
  assert plain_run.returncode == 0, plain_run.stderr[-3000:]
  again = json.loads(open(output).read())
  stop_at = [i for i, t in enumerate(again['continuation']) if t == ids['<|eot_id|>']]
  assert again['continuation'][0] == record['continuation'][0]
  assert len(again['continuation']) == (stop_at[0] + 1 if stop_at else 6) or (
      again['continuation'][-2:] == [1, 2])
