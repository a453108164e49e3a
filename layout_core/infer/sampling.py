"""How the decoder picks each new token, and the random numbers it draws.

    sampling = Sampling(temperature=0.8, top_k=40)      # Sampling() is greedy
    token = sample(logits, sampling=sampling, seed=seed, rows=rows, positions=positions)
    # logits [B, V] float32; rows [B]: each row's index in the whole batch;
    # positions [B]: where the new token goes in its row

Greedy (`temperature` 0) takes the most likely token. Otherwise the logits
are divided by the temperature, cut to the `top_k` most likely tokens and to
the smallest set whose probabilities reach `top_p` (nucleus sampling), and
one token is drawn from the softmax of what is left, by the Gumbel-max trick:
the argmax of logits + Gumbel noise. The noise is a counter-based hash of
(seed, row index in the whole batch, position, token id), like the dropout
masks (`layout_core.model.random`): no random state, nothing that depends on
the device a row lands on, so the same seed gives the same samples on any
mesh and however the batch is split over it, and a row's samples do not
depend on what the other rows hold.

Importing this module does not import TensorFlow.
"""

from __future__ import annotations

import dataclasses
import math

from layout_core.errors import ConfigError
from layout_core.lazy import tf
from layout_core.layout.variables import mix32

_MASK32 = 0xFFFFFFFF
_OFFSET = 0x811C9DC5   # FNV-1a's offset and prime, to combine the counters before mixing
_PRIME = 0x01000193
_UNIFORM_BITS = 23   # float32 holds k + 1/2 exactly for k < 2^23 (uniform_from_bits)


@dataclasses.dataclass(frozen=True)
class Sampling:
  """How each new token is picked (module doc).

      Sampling()                                   # greedy
      Sampling(temperature=1.0, top_p=0.9)         # nucleus sampling

  Attributes:
    temperature: 0 takes the most likely token (greedy; top_k and top_p are
      then unused); > 0 samples from softmax(logits / temperature): below 1
      sharper, above 1 flatter.
    top_k: Sample among the k most likely tokens only; 0 (or k >= the
      vocabulary) keeps them all.
    top_p: Sample among the fewest most likely tokens whose probabilities
      sum to at least top_p, in (0, 1]; 1 keeps them all.
  """
  temperature: float = 0.0  # 0: greedy
  top_k: int = 0            # 0: off
  top_p: float = 1.0        # 1: off

  def __post_init__(self):
    checks = (
        ('temperature', isinstance(self.temperature, (int, float))
         and not isinstance(self.temperature, bool) and math.isfinite(self.temperature)
         and self.temperature >= 0, 'a number >= 0 (0: greedy)'),
        ('top_k', isinstance(self.top_k, int) and not isinstance(self.top_k, bool)
         and self.top_k >= 0, 'an integer >= 0 (0: off)'),
        ('top_p', isinstance(self.top_p, (int, float)) and not isinstance(self.top_p, bool)
         and 0 < self.top_p <= 1, 'a number in (0, 1] (1: off)'),
    )
    for name, good, wanted in checks:
      if not good:
        raise ConfigError(f'sampling {name} is {getattr(self, name)!r}',
                          where=f'Sampling.{name} (--{name})', fix=f'give {wanted}')

  @property
  def greedy(self) -> bool:
    return self.temperature == 0

  def describe(self) -> str:
    if self.greedy:
      return 'greedy'
    parts = [f'temperature {self.temperature:g}']
    if self.top_k:
      parts.append(f'top_k {self.top_k}')
    if self.top_p < 1:
      parts.append(f'top_p {self.top_p:g}')
    return ', '.join(parts)


def sample(logits, *, sampling: Sampling, seed, rows, positions):
  """The next token of each row, int32 [B], from float32 `logits` [B, V].

  `seed`: an integer scalar (Python or tensor); `rows` [B]: each row's index
  in the whole batch; `positions` [B]: where each row's new token goes. The
  noise depends on these alone (module doc)."""
  if sampling.greedy:
    return tf.argmax(logits, axis=-1, output_type=tf.int32)
  scaled = logits / sampling.temperature
  vocab_size = logits.shape[-1]
  if sampling.top_k and sampling.top_k < vocab_size:
    kth = tf.reduce_min(tf.math.top_k(scaled, k=sampling.top_k).values, axis=-1,
                        keepdims=True)
    scaled = _drop(scaled, scaled < kth)
  if sampling.top_p < 1:
    ordered = tf.math.top_k(scaled, k=vocab_size).values             # most likely first
    probs = tf.nn.softmax(ordered, axis=-1)
    before = tf.math.cumsum(probs, axis=-1) - probs                  # mass of the ones before
    kept = tf.where(before < sampling.top_p, ordered, tf.ones_like(ordered) * math.inf)
    scaled = _drop(scaled, scaled < tf.reduce_min(kept, axis=-1, keepdims=True))
  noise = gumbel_noise(seed=seed, rows=rows, positions=positions, vocab_size=vocab_size)
  return tf.argmax(scaled + noise, axis=-1, output_type=tf.int32)


def _drop(logits, where):
  """`logits` with -inf where `where`: those tokens are never drawn."""
  return tf.where(where, tf.ones_like(logits) * -math.inf, logits)


def gumbel_noise(*, seed, rows, positions, vocab_size: int):
  """Gumbel(0, 1) noise [B, vocab_size], float32: a hash of (seed, row,
  position, token id) made uniform in (0, 1) (`uniform_from_bits`), then
  -log(-log(u)); finite everywhere, between -2.8 and 16.7."""
  start = tf.zeros_like(tf.cast(rows, tf.int64)) + _OFFSET   # [B], laid out as the rows
  key = _combine(start, tf.cast(seed, tf.int64))
  key = _combine(key, tf.cast(rows, tf.int64))
  key = _combine(key, tf.cast(positions, tf.int64))
  token = tf.range(vocab_size, dtype=tf.int64)
  bits = _combine(tf.expand_dims(key, 1), tf.expand_dims(token, 0))   # [B, V]
  uniform = uniform_from_bits(bits)
  return -tf.math.log(-tf.math.log(uniform))


def uniform_from_bits(bits):
  """float32 uniform in [2^-24, 1 - 2^-24] from 32-bit values in int64 lanes:
  the top 23 bits k, as (k + 1/2) / 2^23. Each of these 2^23 values is a
  float32 exactly (24 significant bits), so none rounds to 0 or to 1, whose
  noise would be -inf or +inf: a token drawn whatever its probability, or
  NaN where top-k/top-p dropped it (24 bits would round the largest to 1)."""
  top = tf.cast(tf.bitwise.right_shift(bits, 32 - _UNIFORM_BITS), tf.float32)
  return (top + 0.5) / float(1 << _UNIFORM_BITS)


def _combine(key, value):
  """mix32 of (key x FNV prime) xor value: int64 lanes holding 32-bit values."""
  mixed = tf.bitwise.bitwise_xor(tf.bitwise.bitwise_and(key * _PRIME, _MASK32),
                                 tf.bitwise.bitwise_and(value, _MASK32))
  return mix32(mixed)
