"""The library's layers: embedding, layer norm, feed-forward, attention,
dropout, the Transformer block and the softmax projection.

    ffn = FeedForward.Params().Set(name='ffn', input_dim=64, hidden_dim=256)
    FeedForward.fprop_meta(ffn, (8, 16, 64))  # LayerMeta(out_shapes=((8, 16, 64),), ...)
    layer = ffn.Instantiate(parent_path='lm/block_000')
    layer.w_in                                # created as 'lm/block_000/ffn/w_in'
"""

from __future__ import annotations

from layout_core.lazy import tf
from layout_core.errors import ConfigError
from layout_core.layout import fsdp
from layout_core.layout.variables import Normal, Ones, Zeros
from layout_core.model.base import (BaseLayer, Declared, LayerMeta, as_float32,
                                    num_elements as _size)
from layout_core.model.activations import residual
from layout_core.model.random import dropout
from layout_core.model.weights import cast, dense
from layout_core.step_context import current


def check_width(p, x_shape, dim: str) -> None:
  """A ConfigError naming both shapes when x's last dimension is not p.<dim>
  (the model's width against the data's, or the previous layer's)."""
  if x_shape and x_shape[-1] != getattr(p, dim):
    raise ConfigError(f'layer {p.name!r} ({p.cls.__name__}) takes inputs of width '
                      f'{p.name}.{dim} = {getattr(p, dim)}, but its input has shape '
                      f'{list(x_shape)} (from the data or the layer before it)',
                      where=f'{p.name}.{dim}',
                      fix=f'set {dim} to {x_shape[-1]}, or change the feature shape '
                          'or the layer before')


class Embedding(BaseLayer):
  """Token ids [B, T] -> vectors [B, T, D], plus learned positions."""

  @classmethod
  def Params(cls):
    p = super().Params()
    p.name = 'emb'
    p.Define('vocab_size', 256, 'Number of token ids.')
    p.Define('dim', 64, 'Embedding width.')
    p.Define('max_len', 512, 'Longest sequence (position table rows); 0: none.')
    p.Define('init_stddev', 0.02, 'Stddev of the initial embeddings.')
    return p

  @classmethod
  def declare_variables(cls, p):
    looked_up = {0: 'its rows are looked up with a gather, and DTensor cannot gather '
                    'from a table sharded along dimension 0 (the vocabulary); shard '
                    "dimension 1 (the features) instead, e.g. ('unsharded', 'model')"}
    declared = [Declared('table', (p.vocab_size, p.dim), Normal(p.init_stddev),
                         unshardable=looked_up)]
    if p.max_len:
      declared.append(Declared('pos_table', (p.max_len, p.dim), Normal(p.init_stddev)))
    return declared

  @classmethod
  def fprop_meta(cls, p, ids_shape):
    batch, length = ids_shape
    if p.max_len and length > p.max_len:
      raise ConfigError(f'sequence length {length} exceeds {p.name}.max_len={p.max_len}')
    out = (batch, length, p.dim)
    return LayerMeta(out_shapes=(out,), flops=_size(out) * (2 if p.max_len else 1),
                     matmul_flops=0)

  def fprop(self, ids):
    sequence = current().sequence  # packed documents: each token's position within its own
    return self.lookup(self.params, ids, table=fsdp.at_use(self.table),
                       pos_table=fsdp.at_use(self.pos_table) if self.params.max_len else None,
                       positions=None if sequence is None else sequence.positions,
                       dtype=self.compute_dtype)

  @classmethod
  def lookup(cls, p, ids, *, table, pos_table, positions=None, dtype) -> tf.Tensor:
    """The embedding's math: rows of `table` for `ids` [B, T], plus rows of
    `pos_table` for `positions` ([B, T] or [1, T]; None: 0..T-1), in `dtype`.
    The tables are float32 as stored (the cached decoder,
    `layout_core.infer.decode`, calls this with one position per row)."""
    # Rows looked up in float32, then cast (a bfloat16 table would sum the
    # gradients of repeated ids in bfloat16).
    x = cast(tf.gather(table, ids), dtype)
    if p.max_len:
      if positions is None:
        x += cast(pos_table[:ids.shape[1]], dtype)
      else:
        x += cast(tf.gather(pos_table, positions), dtype)
    return x


class LayerNorm(BaseLayer):

  @classmethod
  def Params(cls):
    p = super().Params()
    p.name = 'ln'
    p.Define('dim', 64, 'Normalised (last) dimension.')
    p.Define('epsilon', 1e-6, 'Variance epsilon.')
    return p

  @classmethod
  def declare_variables(cls, p):
    return [Declared('scale', (p.dim,), Ones()), Declared('bias', (p.dim,), Zeros())]

  @classmethod
  def fprop_meta(cls, p, x_shape):
    # mean, subtract, square, mean, rsqrt-multiply, scale, shift
    return LayerMeta(out_shapes=(tuple(x_shape),), flops=7 * _size(x_shape),
                     matmul_flops=0)

  @classmethod
  def apply(cls, p, w, x):
    x32 = as_float32(x)  # statistics in float32 whatever the compute dtype
    mean, variance = tf.nn.moments(x32, axes=[-1], keepdims=True)
    normed = cast((x32 - mean) * tf.math.rsqrt(variance + p.epsilon), x.dtype)
    return normed * w.vector('scale', x) + w.vector('bias', x)


class FeedForward(BaseLayer):
  """x -> act(x W_in + b_in) W_out + b_out."""

  @classmethod
  def Params(cls):
    p = super().Params()
    p.name = 'ffn'
    p.Define('input_dim', 64, 'Input and output width.')
    p.Define('hidden_dim', 256, 'Inner width.')
    p.Define('activation', 'relu', "'relu' or 'gelu'.")
    p.Define('init_stddev', 0.02, 'Stddev of the initial weights.')
    return p

  @classmethod
  def declare_variables(cls, p):
    if p.activation not in ('relu', 'gelu'):
      raise ConfigError(f"{p.name}.activation is {p.activation!r}",
                        fix="use 'relu' or 'gelu'")
    return [Declared('w_in', (p.input_dim, p.hidden_dim), Normal(p.init_stddev)),
            Declared('b_in', (p.hidden_dim,), Zeros()),
            Declared('w_out', (p.hidden_dim, p.input_dim), Normal(p.init_stddev)),
            Declared('b_out', (p.input_dim,), Zeros())]

  @classmethod
  def fprop_meta(cls, p, x_shape):
    check_width(p, x_shape, 'input_dim')
    tokens = _size(x_shape[:-1])
    matmul = 2 * tokens * p.input_dim * p.hidden_dim * 2
    elementwise = tokens * (2 * p.hidden_dim + p.input_dim)  # bias, act, bias
    return LayerMeta(out_shapes=(tuple(x_shape),), flops=matmul + elementwise,
                     matmul_flops=matmul)

  @classmethod
  def apply(cls, p, w, x):
    h = w.dense(x, 'w_in') + w.vector('b_in', x)
    h = tf.nn.relu(h) if p.activation == 'relu' else tf.nn.gelu(h)
    return w.dense(h, 'w_out') + w.vector('b_out', h)


class MultiHeadAttention(BaseLayer):
  """Causal multi-head self-attention; weights [D, H, K] and [H, K, D]."""

  @classmethod
  def Params(cls):
    p = super().Params()
    p.name = 'attn'
    p.Define('model_dim', 64, 'Input and output width.')
    p.Define('num_heads', 4, 'Attention heads.')
    p.Define('head_dim', 0, 'Width per head; 0 means model_dim // num_heads.')
    p.Define('causal', True, 'Mask attention to earlier positions only.')
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
  def declare_variables(cls, p):
    qkv = (p.model_dim, p.num_heads, cls.head_dim(p))
    init = Normal(p.init_stddev)
    return [Declared('wq', qkv, init), Declared('wk', qkv, init),
            Declared('wv', qkv, init),
            Declared('wo', (p.num_heads, cls.head_dim(p), p.model_dim), init)]

  @classmethod
  def fprop_meta(cls, p, x_shape):
    batch, length, dim = x_shape
    heads, head_dim = p.num_heads, cls.head_dim(p)
    tokens = batch * length
    projections = 2 * tokens * dim * heads * head_dim * 4       # q, k, v, out
    scores = 2 * batch * heads * length * length * head_dim * 2  # qk^T and attn.v
    # scale, mask, softmax (exp, sum, divide ~ 3)
    elementwise = batch * heads * length * length * 5
    return LayerMeta(out_shapes=(tuple(x_shape),),
                     flops=projections + scores + elementwise,
                     matmul_flops=projections + scores)

  @classmethod
  def apply(cls, p, w, x):
    return attention(x, w, head_dim=cls.head_dim(p), causal=p.causal)


def attention(x, w, *, head_dim: int, causal: bool):
  """Multi-head attention of x [*lead, batch, time, dim] with w's weights
  'wq', 'wk', 'wv' [*lead, dim, heads, head_dim] and 'wo' [*lead, heads,
  head_dim, dim]. `w.lead` names leading dimensions every operand shares: ''
  for a layer, 's' for the SPMD pipeline's stage slots (each slot with its
  own cell's weights).

  Its three parts are also the cached decoder's (`layout_core.infer.decode`),
  which keeps each position's keys and values instead of recomputing them:
  `attention_inputs` (q, k, v), `attend` (scores, mask, softmax, the
  weighted values) and `attention_output`."""
  q, k, v = attention_inputs(x, w)
  mask = None
  if causal:
    sequence = w.context.sequence
    segments = sequence.segments if sequence is not None and not w.lead else None
    mask = causal_mask(x.shape[-2], dtype=q.dtype, segments=segments)
  context = attend(q, k, v, mask=mask, head_dim=head_dim, lead=w.lead, dtype=x.dtype)
  return attention_output(context, w)


def attention_inputs(x, w):
  """(q, k, v), each [*lead, batch, time, heads, head_dim]: x's projections."""
  return (w.project('btd,dhk->bthk', x, 'wq'), w.project('btd,dhk->bthk', x, 'wk'),
          w.project('btd,dhk->bthk', x, 'wv'))


def causal_mask(length: int, *, dtype, segments=None):
  """1 where query t may see key u (u <= t), else 0: [t, u]; with packed
  documents' `segments` [b, t] also only within one's own document: [b, 1, t, u]."""
  mask = tf.linalg.band_part(tf.ones([length, length], dtype), -1, 0)
  if segments is not None:  # packed documents: stay in one's own
    same = tf.equal(tf.expand_dims(segments, 2), tf.expand_dims(segments, 1))  # [b, t, u]
    mask = mask * tf.expand_dims(tf.cast(same, dtype), 1)  # [b, 1, t, u]
  return mask


def attend(q, k, v, *, mask, head_dim: int, lead: str = '', dtype):
  """Queries q [*lead, b, t, h, k] over keys k and values v [*lead, b, u, h, k]:
  the weighted values [*lead, b, t, h, k], in `dtype`. `mask` (1: may see,
  0: may not; broadcast to the scores [*lead, b, h, t, u]) or None."""
  logits = tf.einsum(f'{lead}bthk,{lead}buhk->{lead}bhtu', q, k) * (head_dim ** -0.5)
  if mask is not None:
    logits += (1.0 - mask) * -1e9
  probs = cast(tf.nn.softmax(as_float32(logits), axis=-1), dtype)  # softmax in float32
  return tf.einsum(f'{lead}bhtu,{lead}buhk->{lead}bthk', probs, v)


def attention_output(context, w):
  """The heads' weighted values [*lead, b, t, h, k] projected back: [*lead, b, t, d]."""
  return w.project('bthk,hkd->btd', context, 'wo')


class Dropout(BaseLayer):
  """Zeroes each element with probability `rate` (scaling the rest by
  1/(1-rate)) in a training step (`Weights.random`); the identity outside one."""

  @classmethod
  def Params(cls):
    p = super().Params()
    p.name = 'dropout'
    p.Define('rate', 0.0, 'Probability of dropping an element.')
    return p

  @classmethod
  def fprop_meta(cls, p, x_shape):
    return LayerMeta(out_shapes=(tuple(x_shape),), flops=2 * _size(x_shape), matmul_flops=0)

  @classmethod
  def apply(cls, p, w, x):
    inputs = w.random()
    if not p.rate or inputs is None:
      return x
    return dropout(x, rate=p.rate, inputs=inputs, lead=w.lead)


class TransformerBlock(BaseLayer):
  """Pre-norm block: x + attn(ln(x)), then x + ffn(ln(x))."""

  @classmethod
  def Params(cls):
    p = super().Params()
    p.name = 'block'
    p.Define('model_dim', 64, 'Residual stream width.')
    p.Define('num_heads', 4, 'Attention heads.')
    p.Define('ffn_dim', 256, 'Feed-forward inner width.')
    p.Define('activation', 'relu', "Feed-forward activation: 'relu' or 'gelu'.")
    p.Define('dropout_rate', 0.0, 'Dropout on the attention and feed-forward outputs.')
    return p

  @classmethod
  def child_params(cls, p):
    children = {
        'ln_attn': LayerNorm.Params().Set(name='ln_attn', dim=p.model_dim),
        'attn': MultiHeadAttention.Params().Set(model_dim=p.model_dim,
                                                num_heads=p.num_heads),
        'ln_ffn': LayerNorm.Params().Set(name='ln_ffn', dim=p.model_dim),
        'ffn': FeedForward.Params().Set(input_dim=p.model_dim, hidden_dim=p.ffn_dim,
                                        activation=p.activation),
    }
    if p.dropout_rate:
      for name in ('attn_dropout', 'ffn_dropout'):
        children[name] = Dropout.Params().Set(name=name, rate=p.dropout_rate)
    return children

  @classmethod
  def fprop_meta(cls, p, x_shape):
    children = cls.child_params(p)
    parts = [c.cls.fprop_meta(c, x_shape) for c in children.values()]
    residual_adds = 2 * _size(x_shape)
    return LayerMeta(out_shapes=(tuple(x_shape),),
                     flops=sum(m.flops for m in parts) + residual_adds,
                     matmul_flops=sum(m.matmul_flops for m in parts))

  @classmethod
  def apply(cls, p, w, x):
    return cls.apply_with(p, w, x)

  @classmethod
  def apply_with(cls, p, w, x, *, attend_fn=None):
    """`apply`, the attention sub-layer replaced by `attend_fn(h)` on the
    normalised stream h when given: the cached decoder's attention
    (`layout_core.infer.decode`), which reads and writes its keys and values."""
    children = cls.child_params(p)

    def run(name, value):
      child = children[name]
      return child.cls.apply(child, w.child(name), value)
    pin = w.context.residual
    x = residual(x, pin)
    normed = run('ln_attn', x)
    attn = run('attn', normed) if attend_fn is None else attend_fn(normed)
    if p.dropout_rate:
      attn = run('attn_dropout', attn)
    x = x + residual(attn, pin)
    ffn = run('ffn', run('ln_ffn', x))
    if p.dropout_rate:
      ffn = run('ffn_dropout', ffn)
    return residual(x + residual(ffn, pin), pin)


class Softmax(BaseLayer):
  """Projection to logits over classes (the loss is applied outside)."""

  @classmethod
  def Params(cls):
    p = super().Params()
    p.name = 'softmax'
    p.Define('input_dim', 64, 'Input width.')
    p.Define('num_classes', 256, 'Output classes (vocabulary).')
    p.Define('init_stddev', 0.02, 'Stddev of the initial weights.')
    return p

  @classmethod
  def declare_variables(cls, p):
    return [Declared('w', (p.input_dim, p.num_classes), Normal(p.init_stddev)),
            Declared('b', (p.num_classes,), Zeros())]

  @classmethod
  def fprop_meta(cls, p, x_shape):
    check_width(p, x_shape, 'input_dim')
    tokens = _size(x_shape[:-1])
    matmul = 2 * tokens * p.input_dim * p.num_classes
    return LayerMeta(out_shapes=(tuple(x_shape[:-1]) + (p.num_classes,),),
                     flops=matmul + tokens * p.num_classes, matmul_flops=matmul)

  def fprop(self, x):
    return self.logits(x, w=self.weight('w'), b=self.weight('b'))

  @classmethod
  def logits(cls, x, *, w, b) -> tf.Tensor:
    """The projection's math: float32 logits of x [..., input_dim]."""
    return as_float32(dense(x, w) + b)  # float32 logits
