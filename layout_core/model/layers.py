"""The library's layers: embedding, layer norm, feed-forward, dropout, the
Transformer block and the softmax projection (attention:
`layout_core.model.attention`).

    ffn = FeedForward.Params().Set(name='ffn', input_dim=64, hidden_dim=256)
    FeedForward.fprop_meta(ffn, (8, 16, 64))  # LayerMeta(out_shapes=((8, 16, 64),), ...)
    layer = ffn.Instantiate(parent_path='lm/block_000')
    layer.w_in                                # created as 'lm/block_000/ffn/w_in'
"""

from __future__ import annotations

from layout_core.lazy import dtensor, tf
from layout_core.errors import ConfigError
from layout_core.layout import fsdp
from layout_core.layout.rules import UNSHARDED
from layout_core.layout.variables import Normal, Ones, Zeros
from layout_core.model.base import (BaseLayer, Declared, LayerMeta, as_float32,
                                    num_elements as _size)
from layout_core.model.activations import residual
from layout_core.model.attention import MultiHeadAttention
from layout_core.model import frozen
from layout_core.model.random import dropout
from layout_core.model.weights import LayerWeights, as_used, cast, dense


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
    p.Define('learned_positions', True,
             'Add a learned position table of max_len rows; False: max_len is only '
             'the longest sequence (rotary positions live in the attention).')
    p.Define('init_stddev', 0.02, 'Stddev of the initial embeddings.')
    return p

  @classmethod
  def declare_variables(cls, p):
    looked_up = {0: 'its rows are looked up with a gather, and DTensor cannot gather '
                    'from a table sharded along dimension 0 (the vocabulary); shard '
                    "dimension 1 (the features) instead, e.g. ('unsharded', 'model')"}
    declared = [Declared('table', (p.vocab_size, p.dim), Normal(p.init_stddev),
                         unshardable=looked_up)]
    if learned_positions(p):
      declared.append(Declared('pos_table', (p.max_len, p.dim), Normal(p.init_stddev)))
    return declared

  @classmethod
  def fprop_meta(cls, p, ids_shape):
    batch, length = ids_shape
    if p.max_len and length > p.max_len:
      raise ConfigError(f'sequence length {length} exceeds {p.name}.max_len={p.max_len}')
    out = (batch, length, p.dim)
    return LayerMeta(out_shapes=(out,), flops=_size(out) * (2 if learned_positions(p) else 1),
                     matmul_flops=0)

  def fprop(self, ids):
    # The step's context as every layer's math receives it: with its weights
    # (`LayerWeights`, made as `BaseLayer.fprop` makes them), not looked up here.
    context = LayerWeights(self, inputs=(ids,)).context
    sequence = context.sequence  # packed documents: each token's position within its own
    return self.lookup(self.params, ids, table=fsdp.at_use(self.table),
                       table_scale=scale_at_use(self.table),
                       pos_table=(as_used(self.pos_table) if learned_positions(self.params)
                                  else None),
                       positions=None if sequence is None else sequence.positions,
                       dtype=self.compute_dtype)

  @classmethod
  def lookup(cls, p, ids, *, table, pos_table, positions=None, dtype,
             table_scale=None) -> tf.Tensor:
    """The embedding's math: rows of `table` for `ids` [B, T] (times their
    rows of `table_scale` [V, 1] for an int8 table, `layout_core.model.frozen`),
    plus rows of `pos_table` for `positions` ([B, T] or [1, T]; None:
    0..T-1), in `dtype`. The tables are as stored (the cached decoder,
    `layout_core.infer.decode`, calls this with one position per row)."""
    # Rows looked up as stored, then cast (a bfloat16 table would sum the
    # gradients of repeated ids in bfloat16).
    x = tf.gather(table, ids)
    if table_scale is not None:
      x = tf.cast(x, tf.float32) * tf.gather(tf.cast(table_scale, tf.float32), ids)
    x = cast(x, dtype)
    if learned_positions(p):
      if positions is None:
        x += cast(pos_table[:ids.shape[1]], dtype)
      else:
        x += cast(tf.gather(pos_table, positions), dtype)
    return x


def learned_positions(p) -> bool:
  """Whether an Embedding's params give it a learned position table."""
  return bool(p.max_len) and p.learned_positions


NORMS = ('layer', 'rms')


class LayerNorm(BaseLayer):
  """Normalises the last dimension: LayerNorm (kind 'layer': centred, then
  scale and bias) or RMSNorm (kind 'rms': divided by the root mean square,
  then scale; Llama's), statistics in float32."""

  @classmethod
  def Params(cls):
    p = super().Params()
    p.name = 'ln'
    p.Define('dim', 64, 'Normalised (last) dimension.')
    p.Define('epsilon', 1e-6, 'Variance epsilon.')
    p.Define('kind', 'layer', "'layer' (LayerNorm: scale and bias) or 'rms' (RMSNorm: scale).")
    return p

  @classmethod
  def declare_variables(cls, p):
    if p.kind not in NORMS:
      raise ConfigError(f'{p.name}.kind is {p.kind!r}', where=f'{p.name}.kind',
                        fix=f"use one of {', '.join(map(repr, NORMS))}")
    if p.kind == 'rms':
      return [Declared('scale', (p.dim,), Ones())]
    return [Declared('scale', (p.dim,), Ones()), Declared('bias', (p.dim,), Zeros())]

  @classmethod
  def fprop_meta(cls, p, x_shape):
    # layer: mean, subtract, square, mean, rsqrt-multiply, scale, shift;
    # rms: square, mean, rsqrt-multiply, scale
    return LayerMeta(out_shapes=(tuple(x_shape),),
                     flops=(4 if p.kind == 'rms' else 7) * _size(x_shape), matmul_flops=0)

  @classmethod
  def apply(cls, p, w, x):
    x32 = as_float32(x)  # statistics in float32 whatever the compute dtype
    if p.kind == 'rms':
      mean_square = tf.reduce_mean(tf.square(x32), axis=-1, keepdims=True)
      return cast(x32 * tf.math.rsqrt(mean_square + p.epsilon), x.dtype) * w.vector('scale', x)
    mean, variance = tf.nn.moments(x32, axes=[-1], keepdims=True)
    normed = cast((x32 - mean) * tf.math.rsqrt(variance + p.epsilon), x.dtype)
    return normed * w.vector('scale', x) + w.vector('bias', x)


FFNS = ('mlp', 'swiglu', 'geglu')
ACTIVATIONS = ('relu', 'gelu', 'gelu_tanh')


def activate(x, activation: str):
  """'relu', 'gelu' (exact), 'gelu_tanh' (GPT-2's tanh approximation) or 'silu'."""
  if activation == 'relu':
    return tf.nn.relu(x)
  if activation == 'silu':
    return tf.nn.silu(x)
  return tf.nn.gelu(x, approximate=activation == 'gelu_tanh')


class FeedForward(BaseLayer):
  """kind 'mlp': x -> act(x W_in + b_in) W_out + b_out; kind 'swiglu' / 'geglu'
  (gated): x -> (silu / gelu_tanh(x W_gate) * x W_up) W_down. Biases where
  `use_bias`."""

  @classmethod
  def Params(cls):
    p = super().Params()
    p.name = 'ffn'
    p.Define('input_dim', 64, 'Input and output width.')
    p.Define('hidden_dim', 256, 'Inner width.')
    p.Define('activation', 'relu', "'relu', 'gelu' or 'gelu_tanh' (kind 'mlp').")
    p.Define('kind', 'mlp', "'mlp', or gated: 'swiglu' (silu) or 'geglu' (gelu_tanh).")
    p.Define('use_bias', True, 'Add a bias after each projection.')
    p.Define('init_stddev', 0.02, 'Stddev of the initial weights.')
    return p

  @classmethod
  def matrices(cls, p) -> tuple[tuple[str, str], ...]:
    """(weight, bias) names in order: in then out, or gate, up, down."""
    if p.kind == 'mlp':
      return (('w_in', 'b_in'), ('w_out', 'b_out'))
    return (('w_gate', 'b_gate'), ('w_up', 'b_up'), ('w_down', 'b_down'))

  @classmethod
  def declare_variables(cls, p):
    if p.kind not in FFNS:
      raise ConfigError(f'{p.name}.kind is {p.kind!r}', where=f'{p.name}.kind',
                        fix=f"use one of {', '.join(map(repr, FFNS))}")
    if p.activation not in ACTIVATIONS:
      raise ConfigError(f"{p.name}.activation is {p.activation!r}",
                        fix=f"use one of {', '.join(map(repr, ACTIVATIONS))}")
    init = Normal(p.init_stddev)
    declared = []
    for weight, bias in cls.matrices(p):
      out = p.input_dim if weight in ('w_out', 'w_down') else p.hidden_dim
      shape = (p.input_dim, p.hidden_dim) if out == p.hidden_dim else (p.hidden_dim, p.input_dim)
      declared.append(Declared(weight, shape, init, inputs=1))
      if p.use_bias:
        declared.append(Declared(bias, (out,), Zeros()))
    return declared

  @classmethod
  def fprop_meta(cls, p, x_shape):
    check_width(p, x_shape, 'input_dim')
    tokens = _size(x_shape[:-1])
    matrices = len(cls.matrices(p))
    matmul = 2 * tokens * p.input_dim * p.hidden_dim * matrices
    # biases, the activation (and the gate's product)
    elementwise = tokens * (matrices * p.hidden_dim + p.input_dim)
    return LayerMeta(out_shapes=(tuple(x_shape),), flops=matmul + elementwise,
                     matmul_flops=matmul)

  @classmethod
  def apply(cls, p, w, x):
    def project(h, weight, bias):
      out = w.dense(h, weight)
      return out + w.vector(bias, h) if p.use_bias else out
    if p.kind == 'mlp':
      h = activate(project(x, 'w_in', 'b_in'), p.activation)
      return project(h, 'w_out', 'b_out')
    gate = activate(project(x, 'w_gate', 'b_gate'), 'silu' if p.kind == 'swiglu' else 'gelu_tanh')
    return project(gate * project(x, 'w_up', 'b_up'), 'w_down', 'b_down')


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
    p.Define('activation', 'relu', "Feed-forward activation: 'relu', 'gelu' or 'gelu_tanh'.")
    p.Define('dropout_rate', 0.0, 'Dropout on the attention and feed-forward outputs.')
    p.Define('norm', 'layer', "The norms: 'layer' (LayerNorm) or 'rms' (RMSNorm).")
    p.Define('norm_epsilon', 1e-6, 'The norms\' variance epsilon.')
    p.Define('ffn', 'mlp', "Feed-forward kind: 'mlp', 'swiglu' or 'geglu'.")
    p.Define('ffn_bias', True, 'Biases in the feed-forward layer.')
    p.Define('num_kv_heads', 0, 'Key/value heads (grouped-query); 0 means num_heads.')
    p.Define('head_dim', 0, 'Width per head; 0 means model_dim // num_heads.')
    p.Define('rope_theta', 0.0, 'Rotary position base; 0: no rotary positions.')
    p.Define('rope_scaling', None, 'Llama 3 rotary frequency scaling (a dict) or None.')
    p.Define('qkv_bias', False, 'Biases on the query, key and value projections.')
    p.Define('attention_out_bias', False, 'A bias on the attention output projection.')
    p.Define('sliding_window', 0, 'Attention to the last sliding_window positions; 0: all.')
    p.Define('moe', None, 'A routed feed-forward layer (`layout_core.model.moe`) in place '
             'of the dense one, as MoEFeedForward params; None: dense.')
    return p

  @classmethod
  def ffn_name(cls, p) -> str:
    """The feed-forward child: 'moe' (routed) or 'ffn' (dense)."""
    return 'moe' if p.moe is not None else 'ffn'

  @classmethod
  def child_params(cls, p):
    def norm(name):
      return LayerNorm.Params().Set(name=name, dim=p.model_dim, kind=p.norm,
                                    epsilon=p.norm_epsilon)
    children = {
        'ln_attn': norm('ln_attn'),
        'attn': MultiHeadAttention.Params().Set(
            model_dim=p.model_dim, num_heads=p.num_heads, num_kv_heads=p.num_kv_heads,
            head_dim=p.head_dim, rope_theta=p.rope_theta, rope_scaling=p.rope_scaling,
            qkv_bias=p.qkv_bias, out_bias=p.attention_out_bias,
            sliding_window=p.sliding_window),
        'ln_ffn': norm('ln_ffn'),
    }
    if p.moe is not None:
      children['moe'] = p.moe.Copy().Set(name='moe', input_dim=p.model_dim)
    else:
      children['ffn'] = FeedForward.Params().Set(input_dim=p.model_dim, hidden_dim=p.ffn_dim,
                                                 activation=p.activation, kind=p.ffn,
                                                 use_bias=p.ffn_bias)
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
    ffn = run(cls.ffn_name(p), run('ln_ffn', x))
    if p.dropout_rate:
      ffn = run('ffn_dropout', ffn)
    return residual(x + residual(ffn, pin), pin)


class Softmax(BaseLayer):
  """Projection to logits over classes (the loss is applied outside), by a
  `w` of its own or, tied (`tied_to`), by a sibling embedding's table."""

  @classmethod
  def Params(cls):
    p = super().Params()
    p.name = 'softmax'
    p.Define('input_dim', 64, 'Input width.')
    p.Define('num_classes', 256, 'Output classes (vocabulary).')
    p.Define('use_bias', True, 'Add a bias to the logits.')
    p.Define('init_stddev', 0.02, 'Stddev of the initial weights.')
    p.Define('tied_to', '', "A sibling's [num_classes, input_dim] embedding table, as "
             "'<layer>/<variable>' under the same parent ('emb/table'), that the "
             'projection reads transposed instead of a w of its own (tied input and output '
             "embeddings); '': its own w.")
    return p

  @classmethod
  def declare_variables(cls, p):
    declared = [] if p.tied_to else [
        Declared('w', (p.input_dim, p.num_classes), Normal(p.init_stddev))]
    if p.use_bias:
      declared.append(Declared('b', (p.num_classes,), Zeros()))
    return declared

  @classmethod
  def fprop_meta(cls, p, x_shape):
    check_width(p, x_shape, 'input_dim')
    tokens = _size(x_shape[:-1])
    matmul = 2 * tokens * p.input_dim * p.num_classes
    return LayerMeta(out_shapes=(tuple(x_shape[:-1]) + (p.num_classes,),),
                     flops=matmul + tokens * p.num_classes, matmul_flops=matmul)

  @classmethod
  def tied_path(cls, p, path: str) -> str | None:
    """The path of the table a tied softmax at `path` reads ('lm/softmax':
    'lm/emb/table'); None untied."""
    return f"{path.rsplit('/', 1)[0]}/{p.tied_to}" if p.tied_to else None

  def link_siblings(self, parent):
    if self.params.tied_to:
      self._tied = TiedTable(tied_variable(parent, self.params.tied_to, where=self.path))

  def fprop(self, x):
    b = self.weight('b') if self.params.use_bias else None
    if self.params.tied_to:
      table = tied_logits_table(self._tied.variable, self.compute_dtype)
      return self.logits(x, table=table, b=b)
    return self.logits(x, w=self.weight('w'), b=b)

  @classmethod
  def logits(cls, x, *, w=None, table=None, b) -> tf.Tensor:
    """The projection's math: float32 logits of x [..., input_dim], by `w`
    [input_dim, num_classes] or, tied, by the embedding `table` [num_classes,
    input_dim] transposed (b: None without a bias)."""
    if table is None:
      out = dense(x, w)
    else:  # DTensor's einsum takes no '...'
      lead = 'abcefghijk'[:x.shape.rank - 1]
      out = tf.einsum(f'{lead}d,vd->{lead}v', x, table)
    return as_float32(out + b if b is not None else out)  # float32 logits


def tied_logits_table(variable, dtype):
  """The embedding table [V, D] `variable` as the tied logits read it, in
  `dtype`: a table stored split over its features (the lookup cannot gather
  from vocabulary-split rows) moves to the same axis over its vocabulary, as
  an untied softmax/w is split, so the logits come out split over the
  vocabulary. (Contracting over the split features instead failed in the
  SPMD pipeline: DTensor could not propagate layouts through its relayouts.)"""
  table = as_used(variable, dtype)
  layout = fsdp.use_layout(variable) or getattr(variable, 'layout', None)
  vocabulary, features = layout.sharding_specs if layout is not None else (None, UNSHARDED)
  if vocabulary != UNSHARDED or features == UNSHARDED:
    return table
  return dtensor.relayout(table, dtensor.Layout([features, UNSHARDED], layout.mesh))


class TiedTable:
  """A tied softmax's reference to the embedding's variable: a plain object,
  so the variable is tracked (checkpointed, listed, trained) once, by the
  layer that owns it."""

  def __init__(self, variable):
    self.variable = variable


def scale_at_use(variable):
  """The scale of an int8 `variable` as the math uses it (`fsdp.at_use`), or None."""
  scale = frozen.scale_of(variable)
  return None if scale is None else fsdp.at_use(scale)


def tied_variable(parent, tied_to: str, *, where: str):
  """The variable `tied_to` ('emb/table') names under `parent`'s children;
  a ConfigError naming both when there is none."""
  layer, _, name = tied_to.partition('/')
  variable = getattr(getattr(parent, layer, None), name, None)
  if not isinstance(variable, tf.Variable):
    raise ConfigError(f'{where} is tied to {tied_to!r}, which is not a variable of a layer '
                      'beside it', where=f'{where} (tied_to)',
                      fix="name a sibling embedding's table, e.g. 'emb/table'")
  return variable
