"""The sampler's noise and the distribution it draws from (layout_core/infer/sampling.py).

The noise is checked over every value the uniform can take, not a random
handful: a 2^-24 event (a uniform of exactly 1) forced tokens whatever their
probability. The draws are checked against softmax(logits / temperature)
cut by top-k and top-p, worked out here with numpy.
"""

import numpy as np
import pytest
import tensorflow as tf

from layout_core.infer.sampling import Sampling, gumbel_noise, sample, uniform_from_bits


def test_every_uniform_value_is_strictly_inside_0_1_and_its_noise_finite():
  # Every one of the 2^23 values, each reached by the lowest and the highest
  # 32-bit pattern that maps to it (the bits below the top 23 are dropped).
  top = np.arange(1 << 23, dtype=np.int64) << 9
  for low_bits in (0, (1 << 9) - 1):
    u = uniform_from_bits(tf.constant(top | low_bits)).numpy()
    assert u.dtype == np.float32
    assert u.min() > 0 and u.max() < 1, (u.min(), u.max())
    assert np.all(np.diff(u) > 0)  # distinct and in order: no two k round together
    np.testing.assert_allclose(u.mean(), 0.5, rtol=1e-6)  # an even grid
    noise = (-np.log(-np.log(u.astype(np.float64)))).astype(np.float32)
    assert np.isfinite(noise).all()
  extremes = tf.constant([0, 1, 255, 511, 512, 1 << 31, (1 << 32) - 512, (1 << 32) - 1],
                         dtype=tf.int64)
  u = uniform_from_bits(extremes).numpy()
  assert u[0] == u[3] == np.float32(2.0 ** -24) and u[-1] == np.float32(1 - 2.0 ** -24)
  noise = (-tf.math.log(-tf.math.log(u))).numpy()  # as gumbel_noise computes it, in float32
  assert np.isfinite(noise).all() and -2.9 < noise.min() and noise.max() < 16.7, noise


def test_the_draws_that_gave_infinite_noise_are_finite():
  """The (row, position) pairs whose noise was +inf at tokens 667, 24745 and
  18902 of a 32k vocabulary (#55), and a wider sweep of positions."""
  noise = gumbel_noise(seed=0, rows=tf.constant([1, 2, 3]), positions=tf.constant([408, 329, 139]),
                       vocab_size=32000).numpy()
  assert np.isfinite(noise).all()
  rows = tf.range(64)
  for position in range(0, 512, 64):
    noise = gumbel_noise(seed=0, rows=rows, positions=tf.fill([64], position),
                         vocab_size=32000).numpy()
    assert np.isfinite(noise).all() and noise.max() < 16.7


def expected_distribution(logits: np.ndarray, sampling: Sampling) -> np.ndarray:
  """softmax(logits / temperature), kept to the top_k most likely and then
  to the fewest whose mass reaches top_p, renormalised: in float64."""
  p = np.exp(logits / sampling.temperature - np.max(logits / sampling.temperature))
  p /= p.sum()
  order = np.argsort(-p)
  keep = np.zeros(p.shape, bool)
  keep[order[:sampling.top_k or len(p)]] = True
  p = np.where(keep, p, 0) / np.sum(p[keep])
  before = np.cumsum(p[order]) - p[order]     # the mass of the more likely ones
  keep[order[before >= sampling.top_p]] = False
  return np.where(keep, p, 0) / np.sum(p[keep])


@pytest.mark.parametrize('sampling', [
    Sampling(temperature=1.0), Sampling(temperature=0.7), Sampling(temperature=1.5, top_k=3),
    Sampling(temperature=1.0, top_p=0.8), Sampling(temperature=0.9, top_k=6, top_p=0.9)],
    ids=lambda s: s.describe().replace(' ', ''))
def test_sampled_frequencies_match_the_cut_softmax(sampling):
  draws, vocab = 40_000, 10
  logits = np.array([2.0, 1.3, 0.9, 0.4, 0.1, -0.3, -0.8, -1.1, -2.0, 0.6], np.float32)
  expected = expected_distribution(logits.astype(np.float64), sampling)
  tokens = sample(tf.constant(np.tile(logits, (draws, 1))), sampling=sampling, seed=7,
                  rows=tf.range(draws), positions=tf.fill([draws], 5)).numpy()
  counts = np.bincount(tokens, minlength=vocab)
  assert np.all(counts[expected == 0] == 0), (counts, expected)  # cut tokens: never
  # Each token's frequency within 5 standard errors of its probability: a
  # false failure about once in 10^5 runs of the 45 kept tokens checked here.
  bound = 5 * np.sqrt(expected * (1 - expected) / draws)
  frequency = counts / draws
  assert np.all(np.abs(frequency - expected) <= bound), np.stack([frequency, expected, bound])


def test_a_positive_control_the_frequency_check_tells_another_temperature_apart():
  """The check above is sharp enough to fail: draws at temperature 1.0 are
  not the distribution of temperature 0.9."""
  draws = 40_000
  logits = np.array([2.0, 1.3, 0.9, 0.4, 0.1, -0.3, -0.8, -1.1, -2.0, 0.6], np.float32)
  tokens = sample(tf.constant(np.tile(logits, (draws, 1))), sampling=Sampling(temperature=1.0),
                  seed=7, rows=tf.range(draws), positions=tf.fill([draws], 5)).numpy()
  other = expected_distribution(logits.astype(np.float64), Sampling(temperature=0.9))
  frequency = np.bincount(tokens, minlength=10) / draws
  assert np.any(np.abs(frequency - other) > 5 * np.sqrt(other * (1 - other) / draws))
