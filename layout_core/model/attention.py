"""Causal self-attention: the layer, and its parts the cached decoder shares.

    attn = MultiHeadAttention.Params().Set(model_dim=64, num_heads=8, num_kv_heads=2,
                                           rope_theta=10000.0)
    q, k, v = attention_inputs(attn, x, w)      # projections, rotated (RoPE)
    out = attention_output(attn, attend(q, k, v, mask=causal_mask(t, dtype=q.dtype),
                                        head_dim=8, dtype=x.dtype), w)

Grouped-query attention (fewer key/value heads), rotary positions with
Llama 3's scaling, a sliding window (Mistral) and biases per projection are
options of the one layer;
`layout_core.model.layers.TransformerBlock` puts it in a block and
`layout_core.infer.decode` runs its parts with a KV cache.
"""

from __future__ import annotations

from layout_core.lazy import tf
from layout_core.errors import ConfigError
from layout_core.layout.variables import Normal, Zeros
from layout_core.model.base import BaseLayer, Declared, LayerMeta, as_float32
from layout_core.model.weights import cast


class MultiHeadAttention(BaseLayer):
  """Causal self-attention; weights wq [D, H, K], wk and wv [D, Hkv, K], wo
  [H, K, D]. Grouped-query where num_kv_heads < num_heads (query head h reads
  key/value head h // (H / Hkv)); rotary positions (RoPE, in the halves
  convention of Hugging Face's Llama) where rope_theta > 0."""

  @classmethod
  def Params(cls):
    p = super().Params()
    p.name = 'attn'
    p.Define('model_dim', 64, 'Input and output width.')
    p.Define('num_heads', 4, 'Attention (query) heads.')
    p.Define('num_kv_heads', 0, 'Key/value heads, dividing num_heads; 0 means num_heads.')
    p.Define('head_dim', 0, 'Width per head; 0 means model_dim // num_heads.')
    p.Define('causal', True, 'Mask attention to earlier positions only.')
    p.Define('sliding_window', 0, 'With causal: query i sees keys j with i - sliding_window '
             '< j <= i (the last sliding_window positions, itself included: Mistral\'s '
             'window); 0: every earlier position.')
    p.Define('rope_theta', 0.0, 'Rotary position base (e.g. 10000); 0: no rotary positions.')
    p.Define('rope_scaling', None, 'None, or Llama 3 frequency scaling: a dict of factor, '
             'low_freq_factor, high_freq_factor, original_max_position_embeddings.')
    p.Define('qkv_bias', False, 'Biases on the query, key and value projections.')
    p.Define('out_bias', False, 'A bias on the output projection.')
    p.Define('init_stddev', 0.02, 'Stddev of the initial weights.')
    return p

  @classmethod
  def head_dim(cls, p) -> int:
    if p.head_dim:
      return p.head_dim
    if p.model_dim % p.num_heads:
      raise ConfigError(f'{p.name}: model_dim {p.model_dim} is not divisible by '
                        f'num_heads {p.num_heads}', fix='set head_dim explicitly')
    return p.model_dim // p.num_heads

  @classmethod
  def kv_heads(cls, p) -> int:
    kv = p.num_kv_heads or p.num_heads
    if p.num_heads % kv:
      raise ConfigError(f'{p.name}: num_kv_heads {kv} does not divide num_heads '
                        f'{p.num_heads}', where='transformer_lm.num_kv_heads',
                        fix='use a divisor of num_heads (1: multi-query attention)')
    return kv

  @classmethod
  def declare_variables(cls, p):
    head_dim, kv = cls.head_dim(p), cls.kv_heads(p)
    if p.rope_theta and head_dim % 2:
      raise ConfigError(f'{p.name}: rotary positions need an even head_dim, not {head_dim}',
                        where='transformer_lm.head_dim', fix='use an even head_dim')
    init = Normal(p.init_stddev)
    declared = [Declared('wq', (p.model_dim, p.num_heads, head_dim), init, inputs=1),
                Declared('wk', (p.model_dim, kv, head_dim), init, inputs=1),
                Declared('wv', (p.model_dim, kv, head_dim), init, inputs=1),
                Declared('wo', (p.num_heads, head_dim, p.model_dim), init, inputs=2)]
    if p.qkv_bias:
      declared += [Declared('bq', (p.num_heads, head_dim), Zeros()),
                   Declared('bk', (kv, head_dim), Zeros()),
                   Declared('bv', (kv, head_dim), Zeros())]
    if p.out_bias:
      declared.append(Declared('bo', (p.model_dim,), Zeros()))
    return declared

  @classmethod
  def fprop_meta(cls, p, x_shape):
    batch, length, dim = x_shape
    heads, kv, head_dim = p.num_heads, cls.kv_heads(p), cls.head_dim(p)
    tokens = batch * length
    projections = 2 * tokens * dim * head_dim * (2 * heads + 2 * kv)   # q, o; k, v
    scores = 2 * batch * heads * length * length * head_dim * 2  # qk^T and attn.v
    # scale, mask, softmax (exp, sum, divide ~ 3)
    elementwise = batch * heads * length * length * 5
    if p.rope_theta:  # q and k: two products and a sum
      elementwise += 3 * tokens * (heads + kv) * head_dim
    return LayerMeta(out_shapes=(tuple(x_shape),),
                     flops=projections + scores + elementwise,
                     matmul_flops=projections + scores)

  @classmethod
  def apply(cls, p, w, x):
    return attention(p, x, w)


def attention(p, x, w):
  """Self-attention (params `p` of a MultiHeadAttention) of x [*lead, batch,
  time, dim] with w's weights 'wq', 'wk', 'wv' [*lead, dim, heads, head_dim]
  and 'wo' [*lead, heads, head_dim, dim]. `w.lead` names leading dimensions
  every operand shares: '' for a layer, 's' for the SPMD pipeline's stage
  slots (each slot with its own cell's weights).

  Its three parts are also the cached decoder's (`layout_core.infer.decode`),
  which keeps each position's keys and values instead of recomputing them:
  `attention_inputs` (q, k, v), `attend` (scores, mask, softmax, the
  weighted values) and `attention_output`."""
  sequence = w.context.sequence if not w.lead else None  # packed documents
  q, k, v = attention_inputs(p, x, w,
                             positions=None if sequence is None else sequence.positions)
  mask = None
  if p.causal:
    segments = None if sequence is None else sequence.segments
    mask = causal_mask(x.shape[-2], dtype=q.dtype, segments=segments, window=p.sliding_window)
  context = attend(q, k, v, mask=mask, head_dim=MultiHeadAttention.head_dim(p), lead=w.lead,
                   dtype=x.dtype)
  return attention_output(p, context, w)


def attention_inputs(p, x, w, *, positions=None):
  """(q [*lead, batch, time, heads, head_dim], k, v [..., kv_heads, head_dim]):
  x's projections, rotated to `positions` ([batch, time] ids; None: 0..time-1)
  where `p` has rotary positions."""
  def project(name, bias):
    out = w.project('btd,dhk->bthk', x, name)
    return out + w.vector(bias, out) if p.qkv_bias else out
  q, k, v = project('wq', 'bq'), project('wk', 'bk'), project('wv', 'bv')
  if p.rope_theta:
    q, k = rotate(q, positions, p), rotate(k, positions, p)
  return q, k, v


def rope_frequencies(head_dim: int, theta: float, scaling=None):
  """The rotary angle per position of each pair of dimensions (i, i + K/2):
  theta^(-2i/K), float32 [K/2]; with Llama 3's `scaling`, the long
  wavelengths divided by its factor and the middle ones blended."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  inverse = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
  if scaling:
    factor, low, high = (float(scaling[k]) for k in ('factor', 'low_freq_factor',
                                                      'high_freq_factor'))
    original = float(scaling['original_max_position_embeddings'])
    wavelength = 2 * np.pi / inverse
    smooth = (original / wavelength - low) / (high - low)
    scaled = np.where(wavelength > original / low, inverse / factor, inverse)
    middle = (wavelength >= original / high) & (wavelength <= original / low)
    inverse = np.where(middle, (1 - smooth) * inverse / factor + smooth * inverse, scaled)
  return inverse.astype(np.float32)


def rotate(x, positions, p):
  """x [*lead, b, t, h, k] rotated by its positions (`attention_inputs`):
  x cos + rotate_half(x) sin, the angles in float32, applied in x's dtype."""
  head_dim, length = x.shape[-1], x.shape[-3]
  if positions is None:
    positions = tf.range(length if length is not None else tf.shape(x)[-3])
  angles = tf.expand_dims(tf.cast(positions, tf.float32), -1) * rope_frequencies(
      head_dim, p.rope_theta, p.rope_scaling)                    # [(b,) t, k/2]
  angles = tf.expand_dims(tf.concat([angles, angles], -1), -2)  # [(b,) t, 1, k]
  cos, sin = cast(tf.cos(angles), x.dtype), cast(tf.sin(angles), x.dtype)
  half = head_dim // 2
  rotated = tf.concat([-x[..., half:], x[..., :half]], -1)
  return x * cos + rotated * sin


def causal_mask(length: int, *, dtype, segments=None, window: int = 0):
  """1 where query t may see key u (u <= t; with a `window` > 0 also
  t - window < u, Hugging Face Mistral's sliding window), else 0: [t, u];
  with packed documents' `segments` [b, t] also only within one's own
  document: [b, 1, t, u]. A document is contiguous in its row, so the window
  counts its own positions there too."""
  mask = tf.linalg.band_part(tf.ones([length, length], dtype), window - 1 if window else -1, 0)
  if segments is not None:  # packed documents: stay in one's own
    same = tf.equal(tf.expand_dims(segments, 2), tf.expand_dims(segments, 1))  # [b, t, u]
    mask = mask * tf.expand_dims(tf.cast(same, dtype), 1)  # [b, 1, t, u]
  return mask


def attend(q, k, v, *, mask, head_dim: int, lead: str = '', dtype):
  """Queries q [*lead, b, t, h, k] over keys k and values v [*lead, b, u, g,
  k] (g = h, or fewer grouped heads: each serves h / g queries in turn): the
  weighted values [*lead, b, t, h, k], in `dtype`. `mask` (1: may see, 0: may
  not; broadcast to the scores [*lead, b, h, t, u]) or None."""
  heads, groups = q.shape[-2], k.shape[-2]
  if groups != heads:  # grouped-query: each key/value head copied to its queries, exactly
    expand = tf.cast(tf.equal(tf.expand_dims(tf.range(heads) // (heads // groups), 0),
                              tf.expand_dims(tf.range(groups), 1)), k.dtype)  # [g, h]
    k = tf.einsum(f'{lead}bugk,gh->{lead}buhk', k, expand)
    v = tf.einsum(f'{lead}bugk,gh->{lead}buhk', v, expand)
  logits = tf.einsum(f'{lead}bthk,{lead}buhk->{lead}bhtu', q, k) * (head_dim ** -0.5)
  if mask is not None:
    logits += (1.0 - mask) * -1e9
  probs = cast(tf.nn.softmax(as_float32(logits), axis=-1), dtype)  # softmax in float32
  return tf.einsum(f'{lead}bhtu,{lead}buhk->{lead}bthk', probs, v)


def attention_output(p, context, w):
  """The heads' weighted values [*lead, b, t, h, k] projected back: [*lead, b, t, d]."""
  out = w.project('bthk,hkd->btd', context, 'wo')
  return out + w.vector('bo', out) if p.out_bias else out
