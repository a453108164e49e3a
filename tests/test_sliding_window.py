"""transformer_lm.sliding_window (Mistral's banded causal mask): query i sees
keys j with i - window < j <= i, as Hugging Face's `sliding_window_overlay`
(`kv_idx > q_idx - sliding_window`) and KerasHub's Mistral (`i < j + window`)
have it.

References: attention written in numpy with the band spelt out (not the
layer's mask), the model without a window where the window covers the
sequence, each packed document alone, and the decoder's cache against
running the whole sequence again. KerasHub's own Mistral is the reference
through the Hugging Face fixtures (tests/hf_fixtures.py: the Mistral
checkpoint has a window of 4, tests/test_hf_models.py compares logits and
greedy tokens), and config.json's field round-trips below.
"""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

from layout_core.convert import hf_config
from layout_core.errors import ConfigError
from layout_core.infer.decode import CachedLM
from layout_core.model.attention import MultiHeadAttention, causal_mask
from layout_core.model.lm import transformer_lm_params
from layout_core.step_context import SequenceInputs, StepContext, entered
from tests import hf_fixtures
from tests.numerics import assert_close

WINDOW = 4
LM = dict(vocab_size=32, model_dim=32, num_heads=4, num_kv_heads=2, ffn_dim=48, num_layers=2,
          max_len=0, norm='rms', positions='rope', ffn='swiglu', output_bias=False)


def test_the_mask_is_the_band_of_the_last_window_positions():
  got = causal_mask(7, dtype=tf.float32, window=3).numpy()
  expected = np.array([[1.0 if i - 3 < j <= i else 0.0 for j in range(7)] for i in range(7)])
  np.testing.assert_array_equal(got, expected)
  assert got[6].tolist() == [0, 0, 0, 0, 1, 1, 1]  # itself and the two before it
  np.testing.assert_array_equal(causal_mask(7, dtype=tf.float32).numpy(), np.tril(np.ones([7, 7])))


def test_attention_with_a_window_equals_numpy_attention_over_the_band():
  p = MultiHeadAttention.Params().Set(name='attn', model_dim=16, num_heads=2,
                                      sliding_window=WINDOW)
  layer = p.Instantiate()
  rng = np.random.default_rng(0)
  for name in layer.variable_names:
    variable = getattr(layer, name)
    variable.assign(rng.normal(0, 0.5, variable.shape).astype(np.float32))
  x = rng.normal(size=(2, 10, 16)).astype(np.float32)
  w = {name: getattr(layer, name).numpy() for name in ('wq', 'wk', 'wv', 'wo')}
  q, k, v = (np.einsum('btd,dhk->bthk', x, w[n]) for n in ('wq', 'wk', 'wv'))
  context = np.zeros_like(q)
  for b in range(2):
    for h in range(2):
      for i in range(10):
        seen = [j for j in range(10) if i - WINDOW < j <= i]
        scores = np.array([q[b, i, h] @ k[b, j, h] for j in seen]) / np.sqrt(8)
        weights = np.exp(scores - scores.max())
        context[b, i, h] = (weights / weights.sum()) @ v[b, seen, h]
  expected = np.einsum('bthk,hkd->btd', context, w['wo'])
  got = tf.function(layer)(tf.constant(x)).numpy()
  assert_close(got, expected, rel=1e-5, what='windowed attention vs numpy')
  plain = MultiHeadAttention.Params().Set(name='attn', model_dim=16, num_heads=2).Instantiate()
  for name in layer.variable_names:
    getattr(plain, name).assign(getattr(layer, name))
  # control: from position WINDOW on, the window leaves keys out
  differs = np.abs(tf.function(plain)(tf.constant(x)).numpy() - got).max(axis=(0, 2))
  assert (differs[:WINDOW] < 1e-5).all() and (differs[WINDOW:] > 1e-3).all(), differs


def _lm(values=None, **settings):
  model = transformer_lm_params(**LM, **settings).Instantiate()
  variables = {v.name[:-2].replace('.', '/'): v for v in model.variables}
  if values is None:
    rng = np.random.default_rng(1)
    values = {path: (rng.normal(0, 0.4, v.shape) + (1 if path.endswith('scale') else 0)
                     ).astype(np.float32) for path, v in variables.items()}
  for path, variable in variables.items():
    variable.assign(values[path])
  return model, values, variables


def test_a_window_covering_the_sequence_is_the_plain_model_and_a_shorter_one_is_not():
  ids = tf.constant(np.random.default_rng(2).integers(0, 32, (2, 12)).astype(np.int32))
  plain, values, _ = _lm()
  covering, _, _ = _lm(values, sliding_window=12)
  short, _, _ = _lm(values, sliding_window=WINDOW)
  reference = plain(ids).numpy()
  np.testing.assert_array_equal(covering(ids).numpy(), reference)
  windowed = short(ids).numpy()
  np.testing.assert_array_equal(windowed[:, :WINDOW], reference[:, :WINDOW])
  assert np.abs(windowed[:, WINDOW:] - reference[:, WINDOW:]).max(axis=-1).min() > 1e-3


def test_a_packed_document_sees_the_window_of_its_own_positions():
  """Two documents in a row: the second (longer than the window) gets the
  logits it has alone with the window."""
  model, _, _ = _lm(sliding_window=WINDOW)
  ids = np.random.default_rng(3).integers(0, 32, (1, 14)).astype(np.int32)
  segments = np.array([[1] * 5 + [2] * 9], np.int32)
  positions = np.array([list(range(5)) + list(range(9))], np.int32)
  alone = model(tf.constant(ids[:, 5:])).numpy()
  with entered(StepContext(sequence=SequenceInputs(tf.constant(segments),
                                                   tf.constant(positions)))):
    packed = model(tf.constant(ids)).numpy()
  assert_close(packed[:, 5:], alone, rel=1e-5, what='second document, packed, windowed')


def test_the_cached_decoder_keeps_the_window():
  """Prompts longer than the window, 8 new tokens: the cached decoder's
  logits and greedy tokens are the windowed forward pass's (running the
  whole sequence again); control: without the window the tokens differ."""
  model, values, variables = _lm(sliding_window=WINDOW)
  decoder = CachedLM(transformer_lm_params(**LM, sliding_window=WINDOW), variables)
  ids = np.random.default_rng(4).integers(0, 32, (3, 10)).astype(np.int32)
  assert_close(decoder.logits(ids).numpy(), model(tf.constant(ids)).numpy(), rel=1e-5,
               what='decoder logits')
  prompts, lengths = ids[:, :6], np.array([6, 5, 2], np.int32)
  cached = decoder.generate(prompts, lengths, max_new_tokens=8).numpy()
  recomputed = decoder.generate_by_recomputing(prompts, lengths, max_new_tokens=8).numpy()
  np.testing.assert_array_equal(cached, recomputed)
  _, _, plain_variables = _lm(values)
  unwindowed = CachedLM(transformer_lm_params(**LM), plain_variables).generate(
      prompts, lengths, max_new_tokens=8).numpy()
  assert not np.array_equal(cached, unwindowed)


def test_config_json_carries_the_window_both_ways():
  config = hf_fixtures.config('mistral', sliding_window=64)
  kwargs, facts = hf_config.lm_kwargs_from_hf(config)
  assert kwargs['sliding_window'] == 64
  written = hf_config.hf_config_from_lm(kwargs, tied=facts.tied)
  assert (written['model_type'], written['sliding_window']) == ('mistral', 64)
  assert hf_config.lm_kwargs_from_hf(written)[0] == kwargs
  none, _ = hf_config.lm_kwargs_from_hf(hf_fixtures.config('mistral', sliding_window=None))
  assert 'sliding_window' not in none  # no window: transformer_lm's default, 0
  assert hf_config.hf_config_from_lm(none, tied=False, kept=config)['sliding_window'] is None
  from plugins.hf import base_config  # pylint: disable=g-import-not-at-top
  assert 'transformer_lm.sliding_window = 64\n' in base_config(kwargs)  # the run records it
  gpt2, _ = hf_config.lm_kwargs_from_hf(hf_fixtures.config('gpt2'))
  with pytest.raises(ConfigError, match='transformer_lm.sliding_window is 8: of the families '
                                        'only Mistral'):
    hf_config.hf_config_from_lm(dict(gpt2, sliding_window=8), tied=True)
  with pytest.raises(ConfigError, match='transformer_lm.sliding_window is -1'):
    transformer_lm_params(**LM, sliding_window=-1)
