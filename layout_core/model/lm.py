"""The LM recipes: a decoder-only Transformer as a Params tree.

    p = transformer_lm_params(vocab_size=64, model_dim=64, num_layers=2)
    lm = p.Instantiate()          # lm/emb, lm/stack/block_000.., lm/final_ln, lm/softmax
"""

from __future__ import annotations

from typing import Sequence

from layout_core.errors import ConfigError
from layout_core.fields import at_least, check_arguments, in_range
from layout_core.model.base import Sequential
from layout_core.model.layers import (ACTIVATIONS, FFNS, NORMS, Embedding, LayerNorm,
                                      Softmax, TransformerBlock)
from layout_core.model.moe import MoEFeedForward, check as check_moe
from layout_core.params import Params


POSITIONS = ('learned', 'rope')
ROPE_SCALING_KEYS = ('factor', 'low_freq_factor', 'high_freq_factor',
                     'original_max_position_embeddings')


def _one_of(name: str, field: str, value, allowed) -> None:
  if value not in allowed:
    raise ConfigError(f'{name}.{field} is {value!r}', where=f'{name}.{field}',
                      fix=f"use one of {', '.join(map(repr, allowed))}")


def _check_cell(name: str, *, num_heads: int, ffn_dim: int, activation: str,
                dropout_rate: float, ffn: str = 'mlp', norm: str = 'layer',
                num_kv_heads: int = 0, head_dim: int = 0, norm_epsilon: float = 1e-6,
                rope_scaling=None, sliding_window: int = 0) -> None:
  at_least(dict(num_heads=num_heads, ffn_dim=ffn_dim, num_kv_heads=num_kv_heads,
                head_dim=head_dim, sliding_window=sliding_window), name, num_heads=1,
           ffn_dim=1, num_kv_heads=0, head_dim=0, sliding_window=0)
  _one_of(name, 'activation', activation, ACTIVATIONS)
  _one_of(name, 'ffn', ffn, FFNS)
  _one_of(name, 'norm', norm, NORMS)
  in_range(dropout_rate, parameter=f'{name}.dropout_rate', low=0, high=1, high_open=True)
  if not norm_epsilon > 0:
    raise ConfigError(f'{name}.norm_epsilon is {norm_epsilon}', where=f'{name}.norm_epsilon',
                      fix='use a small positive epsilon, e.g. 1e-6')
  if num_kv_heads and num_heads % num_kv_heads:
    kv = [d for d in range(1, num_heads + 1) if num_heads % d == 0]
    raise ConfigError(f'{name}.num_kv_heads={num_kv_heads} does not divide '
                      f'{name}.num_heads={num_heads}', where=f'{name}.num_kv_heads',
                      fix=f'use a divisor of num_heads ({", ".join(map(str, kv))}); 1 is '
                          'multi-query attention, 0 (the default) full multi-head')
  if rope_scaling is not None:
    keys = sorted(dict(rope_scaling)) if isinstance(rope_scaling, dict) else None
    if keys != sorted(ROPE_SCALING_KEYS):
      raise ConfigError(f'{name}.rope_scaling is {rope_scaling!r}', where=f'{name}.rope_scaling',
                        fix='give None, or a dict of exactly '
                            f"{', '.join(ROPE_SCALING_KEYS)} (Llama 3's scaling)")


def _block_options(*, norm: str, norm_epsilon: float, ffn: str, ffn_bias: bool | None,
                   num_kv_heads: int, head_dim: int, positions: str, rope_theta: float,
                   rope_scaling, qkv_bias: bool, attention_out_bias: bool,
                   sliding_window: int) -> dict:
  """The TransformerBlock params of the Llama-family options."""
  return dict(norm=norm, norm_epsilon=norm_epsilon, ffn=ffn, sliding_window=sliding_window,
              ffn_bias=(ffn == 'mlp') if ffn_bias is None else bool(ffn_bias),
              num_kv_heads=num_kv_heads, head_dim=head_dim,
              rope_theta=float(rope_theta) if positions == 'rope' else 0.0,
              rope_scaling=dict(rope_scaling) if positions == 'rope' and rope_scaling else None,
              qkv_bias=bool(qkv_bias), attention_out_bias=bool(attention_out_bias))


def transformer_block_params(*, num_heads: int = 4, ffn_dim: int = 256,
                             activation: str = 'relu', dropout_rate: float = 0.0,
                             norm: str = 'layer', norm_epsilon: float = 1e-6,
                             ffn: str = 'mlp', ffn_bias: bool | None = None,
                             num_kv_heads: int = 0, head_dim: int = 0,
                             positions: str = 'learned', rope_theta: float = 10000.0,
                             rope_scaling: dict | None = None, qkv_bias: bool = False,
                             attention_out_bias: bool = False,
                             sliding_window: int = 0) -> Params:
  """One Transformer cell (its width comes from the LM it is put in).

  Args:
    num_heads: Attention heads (>= 1), each model_dim // num_heads wide; must
      divide the model_dim of the LM the cell is put in.
    ffn_dim: Inner width of the feed-forward layer (>= 1).
    activation: Feed-forward activation, 'relu', 'gelu' or 'gelu_tanh' (GPT-2's
      tanh approximation); used by ffn='mlp'.
    dropout_rate: Dropout probability on the attention and feed-forward outputs,
      in [0, 1), applied in training only (evaluation runs without it); 0 adds no
      dropout layers.
    norm, norm_epsilon, ffn, ffn_bias, num_kv_heads, head_dim, positions,
      rope_theta, rope_scaling, qkv_bias, attention_out_bias, sliding_window: as in
      `transformer_lm` (the cell's own; `positions` only decides whether the
      cell rotates its queries and keys).
  """
  check_arguments(transformer_block_params, name='transformer_block', values=locals())
  _check_cell('transformer_block', num_heads=num_heads, ffn_dim=ffn_dim,
              activation=activation, dropout_rate=dropout_rate, ffn=ffn, norm=norm,
              num_kv_heads=num_kv_heads, head_dim=head_dim, norm_epsilon=norm_epsilon,
              rope_scaling=rope_scaling, sliding_window=sliding_window)
  _one_of('transformer_block', 'positions', positions, POSITIONS)
  return TransformerBlock.Params().Set(
      num_heads=num_heads, ffn_dim=ffn_dim, activation=activation, dropout_rate=dropout_rate,
      **_block_options(norm=norm, norm_epsilon=norm_epsilon, ffn=ffn, ffn_bias=ffn_bias,
                       num_kv_heads=num_kv_heads, head_dim=head_dim, positions=positions,
                       rope_theta=rope_theta, rope_scaling=rope_scaling, qkv_bias=qkv_bias,
                       attention_out_bias=attention_out_bias, sliding_window=sliding_window))


def moe_feed_forward_params(*, num_experts: int = 8, experts_per_token: int = 2,
                            expert_dim: int = 0, kind: str = 'swiglu',
                            activation: str = 'relu', router: str = 'softmax',
                            normalize_top_k: bool = True, capacity_factor: float = 0.0,
                            shared_dim: int = 0, shared_gate: bool = True,
                            aux_loss_coef: float = 0.01, z_loss_coef: float = 0.0) -> Params:
  """A routed feed-forward layer (mixture of experts) for `transformer_lm.moe`:
  each token goes to `experts_per_token` of `num_experts` experts
  (`layout_core.model.moe`; docs/moe.md).

  Args:
    num_experts: Experts per MoE layer (E >= 1).
    experts_per_token: Experts each token goes to (top-k, 1..E; Mixtral: 2).
    expert_dim: Inner width of each expert; 0 means the LM's ffn_dim.
    kind: Each expert's feed-forward: 'swiglu' (Mixtral, Qwen-MoE), 'geglu' or 'mlp'.
    activation: The activation of kind 'mlp': 'relu', 'gelu' or 'gelu_tanh'.
    router: 'softmax' over the experts, or 'sigmoid' per expert.
    normalize_top_k: The k chosen weights renormalised to sum to 1 (Mixtral);
      False: the router's probabilities as they are (Qwen2-MoE).
    capacity_factor: Slots per expert and batch row = capacity_factor x
      tokens x k / E; a choice past them is dropped (the token keeps its
      residual). <= 0: no token is dropped.
    shared_dim: Inner width of a shared expert every token goes through (Qwen2-MoE); 0: none.
    shared_gate: The shared expert's output scaled by a sigmoid gate of the token.
    aux_loss_coef: The load-balancing loss's weight in the training loss.
    z_loss_coef: The router z-loss's weight in the training loss.
  """
  check_arguments(moe_feed_forward_params, name='moe_feed_forward', values=locals())
  p = MoEFeedForward.Params().Set(
      num_experts=num_experts, experts_per_token=experts_per_token, hidden_dim=expert_dim,
      kind=kind, activation=activation, router=router, normalize_top_k=normalize_top_k,
      capacity_factor=float(capacity_factor), shared_dim=shared_dim, shared_gate=shared_gate,
      aux_loss_coef=float(aux_loss_coef), z_loss_coef=float(z_loss_coef))
  _one_of('moe_feed_forward', 'kind', kind, FFNS)
  _one_of('moe_feed_forward', 'activation', activation, ACTIVATIONS)
  check_moe(p)
  return p


def _moe_blocks(block: Params, *, moe: Params | None, moe_every: int, ffn_dim: int,
                num_layers: int) -> list[Params]:
  """The stack's blocks: block i routed when (i + 1) % moe_every == 0."""
  routed = block.Copy().Set(moe=moe.Copy().Set(hidden_dim=moe.hidden_dim or ffn_dim))
  return [(routed if (i + 1) % moe_every == 0 else block).Copy().Set(name=f'block_{i:03d}')
          for i in range(num_layers)]


def transformer_lm_params(*, vocab_size: int = 256, model_dim: int = 64,
                          num_heads: int = 4, ffn_dim: int = 256,
                          num_layers: int = 2, max_len: int = 128,
                          activation: str = 'relu', name: str = 'lm',
                          cells: Sequence[Params] | None = None,
                          dropout_rate: float = 0.0, norm: str = 'layer',
                          norm_epsilon: float = 1e-6, positions: str = 'learned',
                          rope_theta: float = 10000.0, rope_scaling: dict | None = None,
                          ffn: str = 'mlp', ffn_bias: bool | None = None,
                          num_kv_heads: int = 0, head_dim: int = 0, qkv_bias: bool = False,
                          attention_out_bias: bool = False, sliding_window: int = 0,
                          output_bias: bool = True, tie_embeddings: bool = False,
                          moe: Params | None = None, moe_every: int = 1) -> Params:
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
    norm: The norms (each block's two and the final one): 'layer' (LayerNorm,
      scale and bias) or 'rms' (RMSNorm, scale only: Llama, Mistral, Qwen2).
    norm_epsilon: The norms' variance epsilon (> 0).
    positions: 'learned' (a max_len x model_dim table added to the embeddings)
      or 'rope' (rotary positions on each block's queries and keys, Hugging
      Face's halves convention; max_len then only limits the length, 0: no
      limit). Packed documents' positions restart at each document.
    rope_theta: The rotary base (Llama 2: 10000, Llama 3: 500000); used by 'rope'.
    rope_scaling: None, or Llama 3.1's frequency scaling, a dict of factor,
      low_freq_factor, high_freq_factor and original_max_position_embeddings.
    ffn: The feed-forward layer: 'mlp' (act(x W_in) W_out, with `activation`),
      or gated: 'swiglu' (silu(x W_gate) * x W_up, then W_down; Llama) or
      'geglu' (the gate through gelu_tanh).
    ffn_bias: Biases in the feed-forward layer; None: on for 'mlp', off for the
      gated kinds.
    num_kv_heads: Key/value heads, a divisor of num_heads: grouped-query
      attention (Llama 3, Mistral, Qwen2); 1 is multi-query; 0 means num_heads.
    head_dim: Width per head; 0 means model_dim // num_heads (which must then
      divide); set it where the heads are not model_dim wide in all.
    qkv_bias: Biases on the query, key and value projections (Qwen2, GPT-2).
    attention_out_bias: A bias on the attention's output projection (GPT-2).
    sliding_window: Each token attends to the last sliding_window positions,
      itself included (query i sees keys j with i - sliding_window < j <= i,
      Hugging Face Mistral's window; in a packed row, of its own document),
      or to every earlier position when it is 0. Imported from Mistral's
      config.json and exported back.
    output_bias: A bias on the logits (softmax/b).
    tie_embeddings: One matrix for the input embedding and the output
      projection: the softmax reads lm/emb/table transposed and has no w of
      its own (GPT-2, small Llama 3.2 and Qwen2 models). Both sit on one mesh:
      the SPMD pipeline takes it, the sub-mesh (GPipe) engine does not.
    moe: A routed feed-forward layer, @moe_feed_forward(), in place of the
      dense one (mixture of experts; docs/moe.md); None: dense. Not with cells.
    moe_every: With moe, block i is routed when (i + 1) % moe_every == 0
      (1: every block; 2: every second one, Qwen2-MoE's decoder_sparse_step).
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
      if model_dim % cell.num_heads and not cell.head_dim:
        divisors = _divisors(model_dim)
        raise ConfigError(f'transformer_lm.cells[{i}] has num_heads={cell.num_heads}, which '
                          f'does not divide transformer_lm.model_dim={model_dim}',
                          where='transformer_block.num_heads / transformer_lm.model_dim',
                          fix=f'use a num_heads dividing {model_dim} ({divisors})')
  else:
    _check_cell('transformer_lm', num_heads=num_heads, ffn_dim=ffn_dim,
                activation=activation, dropout_rate=dropout_rate, ffn=ffn, norm=norm,
                num_kv_heads=num_kv_heads, head_dim=head_dim, norm_epsilon=norm_epsilon,
                rope_scaling=rope_scaling, sliding_window=sliding_window)
    if model_dim % num_heads and not head_dim:
      raise ConfigError(
          f'transformer_lm.num_heads={num_heads} does not divide '
          f'transformer_lm.model_dim={model_dim}',
          where='transformer_lm.num_heads / transformer_lm.model_dim',
          fix=f'set transformer_lm.num_heads to a divisor of {model_dim} '
              f'({_divisors(model_dim)}), or transformer_lm.model_dim to a multiple '
              f'of {num_heads}')
  _one_of('transformer_lm', 'positions', positions, POSITIONS)
  _one_of('transformer_lm', 'norm', norm, NORMS)
  if moe is not None and (cells or not isinstance(moe, Params)
                          or moe.cls is not MoEFeedForward or moe_every < 1):
    raise ConfigError(f'transformer_lm.moe is {moe!r} (moe_every {moe_every}, '
                      f'{len(cells or ())} cells)', where='transformer_lm.moe',
                      fix='give @moe_feed_forward() with moe_every >= 1, and no cells')
  if cells:
    if num_layers != len(cells):
      raise ConfigError(f'transformer_lm.num_layers={num_layers} but {len(cells)} cells '
                        'are given', where='transformer_lm.cells',
                        fix=f'set transformer_lm.num_layers = {len(cells)}')
    stack = Sequential.Params().Set(name='stack', sub=[
        cell.Copy().Set(name=f'block_{i:03d}', model_dim=model_dim)
        for i, cell in enumerate(cells)])
  else:
    block = transformer_block_params(
        num_heads=num_heads, ffn_dim=ffn_dim, activation=activation,
        dropout_rate=dropout_rate, norm=norm, norm_epsilon=norm_epsilon, ffn=ffn,
        ffn_bias=ffn_bias, num_kv_heads=num_kv_heads, head_dim=head_dim,
        positions=positions, rope_theta=rope_theta, rope_scaling=rope_scaling,
        qkv_bias=qkv_bias, attention_out_bias=attention_out_bias,
        sliding_window=sliding_window).Set(model_dim=model_dim)
    if moe is None:
      stack = Sequential.Params().Set(name='stack', sub=[block], repeat=num_layers)
    else:
      stack = Sequential.Params().Set(name='stack', sub=_moe_blocks(
          block, moe=moe, moe_every=moe_every, ffn_dim=ffn_dim, num_layers=num_layers))
  return Sequential.Params().Set(name=name, sub=[
      Embedding.Params().Set(vocab_size=vocab_size, dim=model_dim, max_len=max_len,
                             learned_positions=positions == 'learned'),
      stack,
      LayerNorm.Params().Set(name='final_ln', dim=model_dim, kind=norm, epsilon=norm_epsilon),
      Softmax.Params().Set(input_dim=model_dim, num_classes=vocab_size, use_bias=output_bias,
                           tied_to='emb/table' if tie_embeddings else ''),
  ])


def _divisors(n: int, limit: int = 6) -> str:
  found = [d for d in range(1, n + 1) if n % d == 0]
  return ', '.join(map(str, found[:limit])) + (', ...' if len(found) > limit else '')
