"""The LM recipes: a decoder-only Transformer as a Params tree.

    p = transformer_lm_params(vocab_size=64, model_dim=64, num_layers=2)
    lm = p.Instantiate()          # lm/emb, lm/stack/block_000.., lm/final_ln, lm/softmax
"""

from __future__ import annotations

from typing import Sequence

from layout_core.errors import ConfigError
from layout_core.fields import at_least, check_arguments, in_range
from layout_core.model.base import Sequential
from layout_core.model.layers import Embedding, LayerNorm, Softmax, TransformerBlock
from layout_core.params import Params


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
  """One Transformer cell (its width comes from the LM it is put in).

  Args:
    num_heads: Attention heads (>= 1), each model_dim // num_heads wide; must
      divide the model_dim of the LM the cell is put in.
    ffn_dim: Inner width of the feed-forward layer (>= 1).
    activation: Feed-forward activation, 'relu' or 'gelu'.
    dropout_rate: Dropout probability on the attention and feed-forward outputs,
      in [0, 1), applied in training only (evaluation runs without it); 0 adds no
      dropout layers.
  """
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

  Args:
    vocab_size: Number of token ids (>= 1): rows of the embedding table and
      classes of the softmax; must be at least the task's vocab_size.
    model_dim: Width of the residual stream (embedding, every block, final norm,
      softmax input), >= 1; a multiple of num_heads.
    num_heads: Attention heads of each block, each model_dim // num_heads wide
      (must divide model_dim); unused when cells is given.
    ffn_dim: Inner width of each block's feed-forward layer (>= 1); unused when
      cells is given.
    num_layers: Transformer blocks in the stack (>= 1); with cells, must equal
      len(cells).
    max_len: Rows of the learned position-embedding table, the longest input
      sequence the model takes (the task's seq_len must not exceed it); 0 means
      no position embeddings and no limit.
    activation: Feed-forward activation of each block, 'relu' or 'gelu'; unused
      when cells is given.
    name: Name of the root layer and first component of every variable path
      (lm/emb/table, lm/stack/block_000/...); must be a Python identifier.
    cells: Explicit blocks, one @transformer_block() per layer in order (they may
      differ, e.g. in width), each set to model_dim; None or empty means
      num_layers copies of one block built from num_heads, ffn_dim, activation
      and dropout_rate.
    dropout_rate: Dropout probability on each block's attention and feed-forward
      outputs, in [0, 1), applied in training only; 0 adds no dropout layers;
      unused when cells is given.
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
        divisors = _divisors(model_dim)
        raise ConfigError(f'transformer_lm.cells[{i}] has num_heads={cell.num_heads}, which '
                          f'does not divide transformer_lm.model_dim={model_dim}',
                          where='transformer_block.num_heads / transformer_lm.model_dim',
                          fix=f'use a num_heads dividing {model_dim} ({divisors})')
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
