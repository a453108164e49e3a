"""transformer_lm's Llama-family options (RMSNorm, rotary positions with Llama
3 scaling, SwiGLU, grouped-query attention, biases) against KerasHub's own
Llama, which no one here wrote, and in the decoder, packed documents, the
layout rules' optional axes and the config checks.

Crossed with the engines, FSDP, remat, bf16 and packing in the composition
matrix (`tests/composition.py`, arch=llama); Hugging Face checkpoints in
`tests/test_hf_convert.py`.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from layout_core.errors import ConfigError
from layout_core.infer.decode import CachedLM
from layout_core.layout.rules import LayoutRules
from layout_core.model.attention import rope_frequencies
from layout_core.model.lm import transformer_lm_params
from layout_core.step_context import SequenceInputs, StepContext, entered
from tests.numerics import assert_close

V, LAYERS, HEADS, KV, DIM, FFN = 64, 2, 4, 2, 32, 48
SCALING = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
               original_max_position_embeddings=64)
LLAMA = dict(vocab_size=V, model_dim=DIM, num_heads=HEADS, num_kv_heads=KV, ffn_dim=FFN,
             num_layers=LAYERS, max_len=0, norm='rms', positions='rope', rope_theta=500.0,
             rope_scaling=SCALING, ffn='swiglu', output_bias=False)
# Measured against KerasHub 0.32: 8e-7 of the logits' scale (float32, 12 tokens).
KERAS_HUB_REL = 1e-5


def lm_variables(lm) -> dict:
  return {v.name[:-2].replace('.', '/'): v for v in lm.variables}


def keras_hub_names(layers: int) -> dict:
  """meshgin path -> KerasHub LlamaBackbone weight path."""
  names = {'lm/emb/table': 'token_embedding/embeddings',
           'lm/softmax/w': 'token_embedding/reverse_embeddings',
           'lm/final_ln/scale': 'sequence_output_layernorm/scale'}
  for i in range(layers):
    ours, theirs = f'lm/stack/block_{i:03d}/', f'transformer_layer_{i}/'
    names.update({
        ours + 'attn/wq': theirs + 'self_attention/query/kernel',
        ours + 'attn/wk': theirs + 'self_attention/key/kernel',
        ours + 'attn/wv': theirs + 'self_attention/value/kernel',
        ours + 'attn/wo': theirs + 'self_attention/attention_output/kernel',
        ours + 'ln_attn/scale': theirs + 'self_attention_layernorm/scale',
        ours + 'ln_ffn/scale': theirs + 'feedforward_layernorm/scale',
        ours + 'ffn/w_gate': theirs + 'feedforward_gate_dense/kernel',
        ours + 'ffn/w_up': theirs + 'feedforward_intermediate_dense/kernel',
        ours + 'ffn/w_down': theirs + 'feedforward_output_dense/kernel'})
  return names


@pytest.fixture(scope='module')
def llama():
  """(KerasHub's Llama with random weights, meshgin's LM holding the same
  weights, KerasHub's logits of `ids`, ids)."""
  os.environ.setdefault('KERAS_BACKEND', 'tensorflow')
  keras_hub = pytest.importorskip('keras_hub')
  theirs = keras_hub.models.LlamaBackbone(
      vocabulary_size=V, num_layers=LAYERS, num_query_heads=HEADS, hidden_dim=DIM,
      intermediate_dim=FFN, num_key_value_heads=KV, rope_max_wavelength=500.0,
      layer_norm_epsilon=1e-6, tie_word_embeddings=False,
      rope_frequency_adjustment_factor=SCALING['factor'],
      rope_low_freq_factor=SCALING['low_freq_factor'],
      rope_high_freq_factor=SCALING['high_freq_factor'],
      rope_pretraining_sequence_length=SCALING['original_max_position_embeddings'])
  rng = np.random.default_rng(0)
  for w in theirs.weights:  # large enough that every part shows in the logits
    value = rng.normal(0, 0.3, w.shape)
    w.assign((value + 1 if w.path.endswith('scale') else value).astype(np.float32))
  weights = {w.path: w.numpy() for w in theirs.weights}
  ours = transformer_lm_params(**LLAMA).Instantiate()
  for path, variable in lm_variables(ours).items():
    variable.assign(weights[keras_hub_names(LAYERS)[path]])
  ids = rng.integers(0, V, (2, 12)).astype(np.int32)
  hidden = theirs({'token_ids': ids, 'padding_mask': np.ones_like(ids)}).numpy()
  return theirs, ours, hidden @ weights['token_embedding/reverse_embeddings'], ids


def test_logits_equal_keras_hubs_llama(llama):
  """RMSNorm, rotary positions with Llama 3's frequency scaling (a short
  original context, so all three wavelength bands occur), SwiGLU and two
  query heads per key/value head, as KerasHub computes them."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  _, ours, expected, ids = llama
  assert_close(ours(tf.constant(ids)).numpy(), expected, rel=KERAS_HUB_REL,
               what='logits vs KerasHub Llama')


def test_the_scaled_frequencies_cover_all_three_bands():
  """The fixture's scaling is not vacuous: some frequencies kept, some
  divided by the factor, some blended."""
  plain = rope_frequencies(DIM // HEADS, 500.0)
  scaled = rope_frequencies(DIM // HEADS, 500.0, SCALING)
  ratio = plain / scaled
  assert np.any(np.isclose(ratio, 1.0)), ratio
  assert np.any(np.isclose(ratio, SCALING['factor'])), ratio
  assert np.any((ratio > 1.01) & (ratio < SCALING['factor'] - 0.01)), ratio


def test_the_cached_decoder_keeps_the_grouped_heads_and_decodes_as_recomputing(llama):
  """The decoder's cache holds num_kv_heads heads; its logits are the
  model's own, and the cached greedy tokens equal those of running the whole
  window again (rotary positions per row: prompts of different lengths)."""
  _, ours, expected, ids = llama
  decoder = CachedLM(transformer_lm_params(**LLAMA), lm_variables(ours))
  assert_close(decoder.logits(ids).numpy(), expected, rel=KERAS_HUB_REL,
               what='decoder logits vs KerasHub')
  caches, _ = decoder.prefill(ids[:, :5], np.array([5, 3], np.int32), max_new_tokens=6)
  assert [c.shape.as_list() for c in caches[0]] == [[2, 10, KV, DIM // HEADS]] * 2
  lengths = np.array([5, 3], np.int32)
  cached = decoder.generate(ids[:, :5], lengths, max_new_tokens=6).numpy()
  recomputed = decoder.generate_by_recomputing(ids[:, :5], lengths, max_new_tokens=6).numpy()
  np.testing.assert_array_equal(cached, recomputed)


def test_packed_documents_rotate_by_their_own_positions(llama):
  """A row packing two documents gives the second the logits it has alone:
  it sees only itself, rotated by its positions within the document.
  (Rotary attention depends only on the distance between positions, so a
  document's positions may start anywhere; the packing's are read, not the
  row's.) Positive control: the same row with each document's positions
  spaced twice as far apart differs."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  _, ours, _, ids = llama
  first, second = ids[0, :5], ids[1, :7]
  row = np.concatenate([first, second])[None]
  segments = np.array([[1] * 5 + [2] * 7], np.int32)
  restart = np.array([list(range(5)) + list(range(7))], np.int32)
  alone = ours(tf.constant(second[None])).numpy()[0]

  def packed(positions):
    context = StepContext(sequence=SequenceInputs(tf.constant(segments), tf.constant(positions)))
    with entered(context):
      return ours(tf.constant(row)).numpy()[0, 5:]
  assert_close(packed(restart), alone, rel=1e-5, what='second document, packed')
  assert np.abs(packed(2 * restart) - alone).max() > 1e-2


def test_the_defaults_build_the_classic_model():
  """No option set: the variables (and so the checkpoints and layouts) of
  the model before the options existed, learned positions and biases."""
  paths = sorted(p for p in lm_variables(transformer_lm_params(num_layers=2).Instantiate())
                 if 'block_001' not in p)
  assert paths == sorted([
      'lm/emb/table', 'lm/emb/pos_table',
      'lm/stack/block_000/ln_attn/scale', 'lm/stack/block_000/ln_attn/bias',
      'lm/stack/block_000/attn/wq', 'lm/stack/block_000/attn/wk',
      'lm/stack/block_000/attn/wv', 'lm/stack/block_000/attn/wo',
      'lm/stack/block_000/ln_ffn/scale', 'lm/stack/block_000/ln_ffn/bias',
      'lm/stack/block_000/ffn/w_in', 'lm/stack/block_000/ffn/b_in',
      'lm/stack/block_000/ffn/w_out', 'lm/stack/block_000/ffn/b_out',
      'lm/final_ln/scale', 'lm/final_ln/bias', 'lm/softmax/w', 'lm/softmax/b'])


def test_flops_count_the_gated_and_grouped_projections():
  """fprop_meta's matmul FLOPs (inspect's, the cost model's) by hand."""
  p = transformer_lm_params(**LLAMA)
  block = p.sub[1].sub[0].Copy().Set(model_dim=DIM)
  batch, length = 2, 12
  tokens, head_dim = batch * length, DIM // HEADS
  by_hand = (2 * tokens * DIM * head_dim * (2 * HEADS + 2 * KV)       # q, o; k, v
             + 2 * batch * HEADS * length * length * head_dim * 2     # scores, values
             + 2 * tokens * DIM * FFN * 3)                            # gate, up, down
  assert block.cls.fprop_meta(block, (batch, length, DIM)).matmul_flops == by_hand


@pytest.mark.parametrize('options, words', [
    (dict(num_heads=4, num_kv_heads=3), ('num_kv_heads=3', 'num_heads=4', '1, 2, 4')),
    (dict(rope_scaling={'factor': 8.0}), ('rope_scaling', 'low_freq_factor')),
    (dict(ffn='swish'), ('ffn', "'swiglu'")),
    (dict(norm='batch'), ('norm', "'rms'")),
    (dict(positions='alibi'), ('positions', "'rope'")),
    (dict(norm_epsilon=0.0), ('norm_epsilon',)),
])
def test_a_bad_option_names_itself_and_the_fix(options, words):
  with pytest.raises(ConfigError) as error:
    transformer_lm_params(**{**LLAMA, **options})
  for word in words:
    assert word in str(error.value), str(error.value)


def test_rotary_positions_need_an_even_head_dim():
  p = transformer_lm_params(**{**LLAMA, 'head_dim': 7})
  with pytest.raises(ConfigError, match='even head_dim'):
    p.cls.variable_specs(p)


def test_an_optional_axis_splits_where_it_divides_and_says_where_it_does_not():
  """'model?' (megatron.gin's keys and values): 8 kv heads split over a
  model axis of 4; 2 stay whole, and the resolution says so."""
  rules = LayoutRules([(r'.*/attn/w[kv]', ('unsharded', 'model?', 'unsharded'))])
  axes = {'data': 2, 'model': 4}
  split = rules.resolve('lm/stack/block_000/attn/wk', (64, 8, 16), axes)
  assert split.spec == ('unsharded', 'model', 'unsharded') and not split.left_whole
  whole = rules.resolve('lm/stack/block_000/attn/wk', (64, 2, 16), axes)
  assert whole.spec == ('unsharded',) * 3
  assert "'model' (4) does not divide" in whole.source(rules), whole.source(rules)
  with pytest.raises(ConfigError, match=r"model\?"):  # strict axes still refuse, naming '?'
    LayoutRules([(r'.*/wk', ('unsharded', 'model', 'unsharded'))]).resolve(
        'lm/stack/block_000/attn/wk', (64, 2, 16), axes)
