"""Layers built from Params, with declared variables and cost metadata.

Every layer is a `tf.Module` built by `p.Instantiate(parent_path=...)`. A layer
class answers three questions from its params alone, without running:

  * `declare_variables(p)`: its own variables (name, shape, initializer);
  * `child_params(p)`: its sub-layers, in order;
  * `fprop_meta(p, *input_shapes)`: output shapes and forward FLOPs.

so the whole model's variables (`variable_specs`) and cost per layer
(`fprop_meta`) are known before anything is allocated: `launch.inspect` plans a
100B-parameter model in seconds and the pipeline balances stages by FLOPs.

    p = FeedForward.Params().Set(name='ffn', input_dim=64, hidden_dim=256)
    FeedForward.fprop_meta(p, (8, 16, 64))   # LayerMeta(out_shapes=((8, 16, 64),), ...)
    ffn = p.Instantiate(parent_path='lm/block_000')
    ffn.w_in                                  # created as 'lm/block_000/ffn/w_in'

FLOPs count a multiply-add as 2 (`matmul_flops`) plus one per output element of
each elementwise op (`flops` includes both).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import threading
from typing import Iterator, Mapping, Sequence


from layout_core.lazy import Module, tf
from layout_core.errors import ConfigError
from layout_core.fields import at_least, check_arguments, in_range
from layout_core.params import Params
from layout_core.variables import (Initializer, Normal, Ones, VariableSpec, Zeros,
                                   create_variable, flat_index, mix32, path_seed)

Shape = tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class LayerMeta:
  out_shapes: tuple[Shape, ...]
  flops: int         # all forward FLOPs, matmul + elementwise
  matmul_flops: int  # 2 * multiply-adds of the dense contractions


@dataclasses.dataclass(frozen=True)
class Declared:
  """A variable a layer owns: its attribute name, shape and initializer, and
  the dimensions DTensor cannot run it sharded on (with why, and what works)."""
  name: str
  shape: Shape
  initializer: Initializer
  unshardable: Mapping[int, str] = dataclasses.field(default_factory=dict)


def _size(shape: Shape) -> int:
  return math.prod(shape)


def dense(x: tf.Tensor, w: tf.Tensor) -> tf.Tensor:
  """x[..., d] @ w[d, f]: a matmul for 2-D x (on CPU the einsum kernel's
  forward + backward took 2x as long at [16, 1024] x [1024, 1024]), else an
  einsum with explicit letters (DTensor's einsum has no '...' broadcasting)."""
  if x.shape.rank == 2:
    return tf.matmul(x, w)
  batch = 'abcefgh'[:x.shape.rank - 1]
  return tf.einsum(f'{batch}d,df->{batch}f', x, w)


class BaseLayer(Module):
  """Params-built module (a tf.Module once built, see `layout_core.lazy`);
  subclasses declare variables, children and costs."""

  @classmethod
  def Params(cls) -> Params:
    p = Params()
    p.Define('cls', cls, 'Layer class that Instantiate() builds.')
    p.Define('name', cls.__name__.lower(), 'Layer name: its variable path component.')
    p.Define('dtype', 'float32', 'Variable dtype.')
    return p

  def __init__(self, params: Params, *, parent_path: str = ''):
    if not params.name or not params.name.isidentifier():
      raise ConfigError(f'layer name {params.name!r} must be an identifier',
                        where=f"{parent_path or '<root>'} ({type(self).__name__})")
    super().__init__(name=params.name)
    self.params = params.Copy().Freeze()
    self.path = f'{parent_path}/{params.name}' if parent_path else params.name
    for spec in self.own_variable_specs(self.params, self.path):
      setattr(self, spec.path.rsplit('/', 1)[1], create_variable(spec))
    self.child_names = tuple(self.child_params(self.params))
    for name, child in self.child_params(self.params).items():
      setattr(self, name, child.Instantiate(parent_path=self.path))

  # -- declarations (classmethods: usable without building) ---------------------
  @classmethod
  def declare_variables(cls, p: Params) -> list[Declared]:
    return []

  @classmethod
  def child_params(cls, p: Params) -> dict[str, Params]:
    return {}

  @classmethod
  def own_variable_specs(cls, p: Params, path: str) -> list[VariableSpec]:
    return [VariableSpec(path=f'{path}/{d.name}', shape=tuple(d.shape),
                         initializer=d.initializer, dtype=p.dtype,
                         unshardable=dict(d.unshardable))
            for d in cls.declare_variables(p)]

  @classmethod
  def variable_specs(cls, p: Params, parent_path: str = '') -> list[VariableSpec]:
    """Every variable this layer and its children would create, in order."""
    path = f'{parent_path}/{p.name}' if parent_path else p.name
    specs = cls.own_variable_specs(p, path)
    for child in cls.child_params(p).values():
      specs += child.cls.variable_specs(child, path)
    return specs

  @classmethod
  def fprop_meta(cls, p: Params, *input_shapes: Shape) -> LayerMeta:
    raise NotImplementedError(f'{cls.__name__}.fprop_meta')

  # -- running ------------------------------------------------------------------
  def children(self) -> list['BaseLayer']:
    return [getattr(self, n) for n in self.child_names]

  def fprop(self, *inputs):
    raise NotImplementedError

  def __call__(self, *inputs):
    return self.fprop(*inputs)


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
    x = tf.gather(self.table, ids)
    if self.params.max_len:
      x += self.pos_table[:ids.shape[1]]
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

  def fprop(self, x):
    mean, variance = tf.nn.moments(x, axes=[-1], keepdims=True)
    normed = (x - mean) * tf.math.rsqrt(variance + self.params.epsilon)
    return normed * self.scale + self.bias


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
    tokens = _size(x_shape[:-1])
    matmul = 2 * tokens * p.input_dim * p.hidden_dim * 2
    elementwise = tokens * (2 * p.hidden_dim + p.input_dim)  # bias, act, bias
    return LayerMeta(out_shapes=(tuple(x_shape),), flops=matmul + elementwise,
                     matmul_flops=matmul)

  def fprop(self, x):
    h = dense(x, self.w_in) + self.b_in
    h = tf.nn.relu(h) if self.params.activation == 'relu' else tf.nn.gelu(h)
    return dense(h, self.w_out) + self.b_out


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
  def _head_dim(cls, p) -> int:
    if p.head_dim:
      return p.head_dim
    if p.model_dim % p.num_heads:
      raise ConfigError(f'{p.name}: model_dim {p.model_dim} is not divisible by '
                        f'num_heads {p.num_heads}', fix='set head_dim explicitly')
    return p.model_dim // p.num_heads

  @classmethod
  def declare_variables(cls, p):
    qkv = (p.model_dim, p.num_heads, cls._head_dim(p))
    init = Normal(p.init_stddev)
    return [Declared('wq', qkv, init), Declared('wk', qkv, init),
            Declared('wv', qkv, init),
            Declared('wo', (p.num_heads, cls._head_dim(p), p.model_dim), init)]

  @classmethod
  def fprop_meta(cls, p, x_shape):
    batch, length, dim = x_shape
    heads, head_dim = p.num_heads, cls._head_dim(p)
    tokens = batch * length
    projections = 2 * tokens * dim * heads * head_dim * 4       # q, k, v, out
    scores = 2 * batch * heads * length * length * head_dim * 2  # qk^T and attn.v
    # scale, mask, softmax (exp, sum, divide ~ 3)
    elementwise = batch * heads * length * length * 5
    return LayerMeta(out_shapes=(tuple(x_shape),),
                     flops=projections + scores + elementwise,
                     matmul_flops=projections + scores)

  def fprop(self, x):
    p = self.params
    return attention(x, self.wq, self.wk, self.wv, self.wo, head_dim=self._head_dim(p),
                     causal=p.causal)


def attention(x, wq, wk, wv, wo, *, head_dim: int, causal: bool, lead: str = ''):
  """Multi-head attention of x [*lead, batch, time, dim] with weights
  [*lead, dim, heads, head_dim] (wo: [*lead, heads, head_dim, dim]). `lead`
  names leading dimensions every operand shares: '' for a layer, 's' for the
  SPMD pipeline's stage slots (each slot with its own cell's weights)."""
  q = tf.einsum(f'{lead}btd,{lead}dhk->{lead}bthk', x, wq)
  k = tf.einsum(f'{lead}btd,{lead}dhk->{lead}bthk', x, wk)
  v = tf.einsum(f'{lead}btd,{lead}dhk->{lead}bthk', x, wv)
  logits = tf.einsum(f'{lead}bthk,{lead}buhk->{lead}bhtu', q, k) * (head_dim ** -0.5)
  if causal:
    length = x.shape[-2]
    mask = tf.linalg.band_part(tf.ones([length, length], logits.dtype), -1, 0)
    logits += (1.0 - mask) * -1e9
  probs = tf.nn.softmax(logits, axis=-1)
  context = tf.einsum(f'{lead}bhtu,{lead}buhk->{lead}bthk', probs, v)
  return tf.einsum(f'{lead}bthk,{lead}hkd->{lead}btd', context, wo)


# -- randomness -----------------------------------------------------------------
_random = threading.local()


@contextlib.contextmanager
def random_context(*, seed: tf.Tensor, batch_offset: int = 0) -> Iterator[None]:
  """Turns on random layers (Dropout) for the code inside, e.g. a training step.

  `seed` is an int scalar tensor (the trainer gives run seed x step);
  `batch_offset` is the index of this micro-batch's first row in the global
  batch. Masks are a counter-based hash of (seed, layer path, global element
  index), so they do not depend on the layout, and a pipelined micro-batch
  draws exactly the mask the same rows get in an unpipelined step: distinct
  per micro-batch, deterministic, and identical when the backward pass
  re-computes a stage. Outside a context (evaluation) random layers are the
  identity.
  """
  previous = getattr(_random, 'state', None)
  _random.state = (seed, batch_offset)
  try:
    yield
  finally:
    _random.state = previous


def step_seed(run_seed: int, step):
  """The seed of one training step (int64 tensor or Python int step)."""
  return step * 0x9E3779B1 + (run_seed & 0xFFFFFFFF)


class Dropout(BaseLayer):
  """Zeroes each element with probability `rate` (scaling the rest by
  1/(1-rate)) inside a `random_context`; the identity outside one."""

  @classmethod
  def Params(cls):
    p = super().Params()
    p.name = 'dropout'
    p.Define('rate', 0.0, 'Probability of dropping an element.')
    return p

  @classmethod
  def fprop_meta(cls, p, x_shape):
    return LayerMeta(out_shapes=(tuple(x_shape),), flops=2 * _size(x_shape), matmul_flops=0)

  def fprop(self, x):
    state = getattr(_random, 'state', None)
    if not self.params.rate or state is None:
      return x
    seed, batch_offset = state
    shape = tuple(x.shape.as_list())
    index = flat_index(shape) + batch_offset * _size(shape[1:])
    key = mix32(tf.bitwise.bitwise_and(
        tf.cast(seed, tf.int64) * 0x85EBCA77 + path_seed(self.path, 0), 0xFFFFFFFF))
    bits = mix32(tf.bitwise.bitwise_and(index * 2 + key, 0xFFFFFFFF))
    keep = tf.cast(bits, tf.float32) >= self.params.rate * 4294967296.0
    return tf.where(keep, x / (1.0 - self.params.rate), tf.zeros_like(x))


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

  def fprop(self, x):
    attn, ffn = self.attn(self.ln_attn(x)), None
    if self.params.dropout_rate:
      attn = self.attn_dropout(attn)
    x = x + attn
    ffn = self.ffn(self.ln_ffn(x))
    if self.params.dropout_rate:
      ffn = self.ffn_dropout(ffn)
    return x + ffn


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
    tokens = _size(x_shape[:-1])
    matmul = 2 * tokens * p.input_dim * p.num_classes
    return LayerMeta(out_shapes=(tuple(x_shape[:-1]) + (p.num_classes,),),
                     flops=matmul + tokens * p.num_classes, matmul_flops=matmul)

  def fprop(self, x):
    return dense(x, self.w) + self.b


class Sequential(BaseLayer):
  """Runs `sub` layers in order, `repeat` times (children `name_000`, ...).

  With repeat == 1 children keep their own names; with repeat > 1 each copy of
  sub-layer `s` is named `s_000`, `s_001`, ...
  """

  @classmethod
  def Params(cls):
    p = super().Params()
    p.name = 'seq'
    p.Define('sub', [], 'Params of the layers to run in order.')
    p.Define('repeat', 1, 'How many times to repeat the whole `sub` list.')
    return p

  @classmethod
  def child_params(cls, p):
    if p.repeat < 1:
      raise ConfigError(f'{p.name}.repeat is {p.repeat}', fix='use a positive count')
    children = {}
    for r in range(p.repeat):
      for sub in p.sub:
        child = sub.Copy()
        if p.repeat > 1:
          child.name = f'{sub.name}_{r:03d}'
        if child.name in children:
          raise ConfigError(f"{p.name} has two sub-layers named '{child.name}'",
                            fix='give each sub-layer a distinct name')
        children[child.name] = child
    return children

  @classmethod
  def fprop_meta(cls, p, *shapes):
    flops = matmul = 0
    for child in cls.child_params(p).values():
      meta = child.cls.fprop_meta(child, *shapes)
      flops, matmul = flops + meta.flops, matmul + meta.matmul_flops
      shapes = meta.out_shapes
    return LayerMeta(out_shapes=tuple(shapes), flops=flops, matmul_flops=matmul)

  def fprop(self, *inputs):
    outputs = inputs
    for child in self.children():
      outputs = child(*outputs)
      if not isinstance(outputs, tuple):
        outputs = (outputs,)
    return outputs[0] if len(outputs) == 1 else outputs


ACTIVATIONS = ('relu', 'gelu')


def _check_cell(name: str, *, num_heads: int, ffn_dim: int, activation: str,
                dropout_rate: float) -> None:
  at_least(dict(num_heads=num_heads, ffn_dim=ffn_dim), name, num_heads=1, ffn_dim=1)
  if activation not in ACTIVATIONS:
    raise ConfigError(f'{name}.activation is {activation!r}', where=f'{name}.activation',
                      fix=f"use one of {', '.join(map(repr, ACTIVATIONS))}")
  in_range(dropout_rate, parameter=f'{name}.dropout_rate', low=0, high=1, high_open=True)


def transformer_block_params(*, num_heads: int = 4, ffn_dim: int = 256,
                             activation: str = 'relu', dropout_rate: float = 0.0) -> Params:
  """One Transformer cell (its width comes from the LM it is put in)."""
  check_arguments(transformer_block_params, name='transformer_block', values=locals())
  _check_cell('transformer_block', num_heads=num_heads, ffn_dim=ffn_dim,
              activation=activation, dropout_rate=dropout_rate)
  return TransformerBlock.Params().Set(num_heads=num_heads, ffn_dim=ffn_dim,
                                       activation=activation, dropout_rate=dropout_rate)


def transformer_lm_params(*, vocab_size: int = 256, model_dim: int = 64,
                          num_heads: int = 4, ffn_dim: int = 256,
                          num_layers: int = 2, max_len: int = 128,
                          activation: str = 'relu', name: str = 'lm',
                          cells: Sequence[Params] | None = None,
                          dropout_rate: float = 0.0) -> Params:
  """A decoder-only Transformer LM as a flat Sequential of heterogeneous layers:

  lm/emb -> lm/stack/block_000..N-1 -> lm/final_ln -> lm/softmax (logits).

  The stack is `num_layers` copies of one block (num_heads, ffn_dim,
  activation, dropout_rate), or the explicit list `cells` (e.g. blocks of different widths),
  each set to `model_dim`; `num_layers` must then equal len(cells).
  """
  check_arguments(transformer_lm_params, name='transformer_lm', values=locals())
  at_least(locals(), 'transformer_lm', vocab_size=1, model_dim=1, num_layers=1, max_len=0)
  if not name.isidentifier():
    raise ConfigError(f'transformer_lm.name {name!r} is not an identifier',
                      where='transformer_lm.name', fix="use a name like 'lm'")
  if cells:
    for i, cell in enumerate(cells):
      if not isinstance(cell, Params) or cell.cls is not TransformerBlock:
        raise ConfigError(f'transformer_lm.cells[{i}] is {cell!r}, not a Transformer cell',
                          where='transformer_lm.cells',
                          fix='list cells made by @transformer_block()')
      if model_dim % cell.num_heads:
        raise ConfigError(
            f'transformer_lm.cells[{i}] has num_heads={cell.num_heads}, which does not '
            f'divide transformer_lm.model_dim={model_dim}',
            where='transformer_block.num_heads / transformer_lm.model_dim',
            fix=f'use a num_heads dividing {model_dim} ({_divisors(model_dim)})')
  else:
    _check_cell('transformer_lm', num_heads=num_heads, ffn_dim=ffn_dim,
                activation=activation, dropout_rate=dropout_rate)
    if model_dim % num_heads:
      raise ConfigError(
          f'transformer_lm.num_heads={num_heads} does not divide '
          f'transformer_lm.model_dim={model_dim}',
          where='transformer_lm.num_heads / transformer_lm.model_dim',
          fix=f'set transformer_lm.num_heads to a divisor of {model_dim} '
              f'({_divisors(model_dim)}), or transformer_lm.model_dim to a multiple '
              f'of {num_heads}')
  if cells:
    if num_layers != len(cells):
      raise ConfigError(f'transformer_lm.num_layers={num_layers} but {len(cells)} cells '
                        'are given', where='transformer_lm.cells',
                        fix=f'set transformer_lm.num_layers = {len(cells)}')
    stack = Sequential.Params().Set(name='stack', sub=[
        cell.Copy().Set(name=f'block_{i:03d}', model_dim=model_dim)
        for i, cell in enumerate(cells)])
  else:
    block = transformer_block_params(num_heads=num_heads, ffn_dim=ffn_dim,
                                     activation=activation,
                                     dropout_rate=dropout_rate).Set(model_dim=model_dim)
    stack = Sequential.Params().Set(name='stack', sub=[block], repeat=num_layers)
  return Sequential.Params().Set(name=name, sub=[
      Embedding.Params().Set(vocab_size=vocab_size, dim=model_dim, max_len=max_len),
      stack,
      LayerNorm.Params().Set(name='final_ln', dim=model_dim),
      Softmax.Params().Set(input_dim=model_dim, num_classes=vocab_size),
  ])


def _divisors(n: int, limit: int = 6) -> str:
  found = [d for d in range(1, n + 1) if n % d == 0]
  return ', '.join(map(str, found[:limit])) + (', ...' if len(found) > limit else '')


def num_parameters(p: Params) -> int:
  return sum(s.num_elements for s in p.cls.variable_specs(p))


def flatten_layers(p: Params) -> list[Params]:
  """Leaf layers of nested/repeated Sequentials, in execution order.

  Leaves keep the names they would have as children (block_000, ...), so a
  stage built from them creates variables at recognisable paths.
  """
  return [leaf for _, leaf in leaf_layers(p)]


def leaf_layers(p: Params, parent_path: str = '') -> list[tuple[str, Params]]:
  """(path, params) of every leaf layer, in execution order: the paths the
  leaves get when `p` is instantiated (`lm/emb`, `lm/stack/block_000`, ...)."""
  path = f'{parent_path}/{p.name}' if parent_path else p.name
  if p.cls is not Sequential:
    return [(path, p.Copy())]
  leaves = []
  for child in Sequential.child_params(p).values():
    leaves += leaf_layers(child, path)
  return leaves


def leaf_modules(layer: BaseLayer) -> list[BaseLayer]:
  """The built leaf layers of `layer`, in execution order (cf. `leaf_layers`)."""
  if layer.params.cls is not Sequential:  # as in leaf_layers: subclasses are leaves
    return [layer]
  return [leaf for child in layer.children() for leaf in leaf_modules(child)]
