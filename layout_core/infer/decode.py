"""Text from a trained Transformer LM, one new token at a time, with a KV cache.

    lm = CachedLM(params, weights)     # params: transformer_lm_params(...); weights:
                                       # path -> variable ('lm/stack/block_000/attn/wq', ...)
    lm.logits(tokens)                  # [B, T, V] float32: the model's own forward pass
    lm.generate(prompts, lengths, max_new_tokens=32, sampling=Sampling(), seed=0)
    # [B, 32] int32: each row's new tokens (DONE after its first stop id or stop sequence)

`generate` first runs the prompts through the model once (the prefill),
keeping every layer's keys and values, then feeds one position per new token:
each step projects only the newest token and attends over the kept keys and
values (the cache), instead of running the whole prefix again as
`generate_by_recomputing` (the reference) does. Prompts of different lengths
share a batch, right-padded: every row has its own positions (its new tokens
go at length, length + 1, ...), so each row equals its prompt decoded alone.
Everything is one traceable function (the steps are a `tf.while_loop`, every
shape fixed: a layer's cache is [B, P + max_new_tokens - 1, kv_heads, head_dim]
for prompts padded to P), which a caller may trace into its own
`tf.function` (a SavedModel's signature) on plain tensors; called eagerly it
compiles one function per setting and returns host tensors.

Each layer's math is the layers' own, written once in
`layout_core.model.layers` and `layout_core.model.attention`:
`Embedding.lookup`, `LayerNorm.apply`, `TransformerBlock.apply_with` (its attention swapped for the cached one,
built from `attention_inputs`, `attend` and `attention_output`),
`FeedForward.apply`, `Softmax.logits`. The cache's [B, time, heads,
head_dim] order is the projections' own ('bthk'), so the one `attend`
scores a whole prefix and a cached step alike.

On a mesh (the weights are DVariables) the batch is split over `batch_axis`
(padded with idle rows to a multiple of its size) and each cache is laid out
as the attention weights are: its heads split over the axis `wk`'s heads
are split over (Megatron's 'model'). With plain variables or tensors no
DTensor op runs at all. Sampling (`layout_core.infer.sampling`) draws from a
counter-based hash of (seed, row, position): the same seed gives the same
tokens on any mesh.
"""

from __future__ import annotations

import itertools
from typing import Mapping, Sequence

import numpy as np

from layout_core.errors import ConfigError
from layout_core.infer.lm_layers import (LMLayers, TensorWeights, check_fits, check_weights,
                                         compute_dtype, lm_layers, mesh_of, positions_needed)
from layout_core.infer import stops
from layout_core.infer.sampling import Sampling, sample
from layout_core.layout import fsdp
from layout_core.layout.mesh import UNFOLDED_LENGTH, mesh_axes, pack_global_array
from layout_core.layout.rules import UNSHARDED
from layout_core.layout.variables import to_numpy
from layout_core.lazy import dtensor, tf
from layout_core.model import frozen
from layout_core.model.attention import (MultiHeadAttention, attend, attention_inputs,
                                         attention_output, causal_mask)
from layout_core.model.layers import (Embedding, LayerNorm, Softmax, TransformerBlock,
                                      learned_positions, tied_logits_table)
from layout_core.params import Params

# Re-exported: the decoder's callers check models and prompts through this module.
__all__ = ['DONE', 'CachedLM', 'LMLayers', 'TensorWeights', 'check_fits', 'lm_layers',
           'positions_needed']

DONE = -1  # a row's tokens after its first stop id
_LOOP_NUMBERS = itertools.count()  # distinct names for the traced decoding loops
def _size(x, axis: int):
  """Dimension `axis` of x: a Python int when static, else a tensor."""
  return x.shape[axis] if x.shape[axis] is not None else tf.shape(x)[axis]


def _select(x, index):
  """x [B, T, ...] at each row's `index` [B]: [B, 1, ...]. A one-hot sum,
  which is exact (the other rows add zeros) and needs no batched gather.
  (Python slicing, `x[:, None]`, is avoided on sharded tensors here: DTensor
  failed to lay out its StridedSlice, or crashed.)"""
  hit = tf.cast(_one_hot(index, _size(x, 1)), x.dtype)
  for _ in range(x.shape.rank - 2):
    hit = tf.expand_dims(hit, -1)
  return tf.reduce_sum(x * hit, axis=1, keepdims=True)


def _one_hot(index, length):
  """[B, length] bool: True at each row's `index` [B]."""
  return tf.equal(tf.expand_dims(tf.range(length), 0), tf.expand_dims(index, 1))


class CachedLM:
  """A Transformer LM's forward pass and decoding over given weights (module doc).

  Args:
    params: The LM's Params tree (`transformer_lm_params`, a run's
      `plan.params`).
    weights: Variable path -> tf.Variable, DVariable or tensor, every path of
      the model (`lm/emb/table`, `lm/stack/block_000/attn/wq`, ...; as in a
      run's layouts.txt); other entries are ignored.
    batch_axis: The mesh axis the batch is split over when the weights are on
      a mesh (a run's train.batch_axis); a name the mesh lacks: replicated.
  """

  def __init__(self, params: Params, weights: Mapping[str, object], *,
               batch_axis: str = 'data'):
    self.layers = lm_layers(params)
    self.params = params
    self._values = dict(weights)
    check_weights(params, self._values)
    self.max_len, self.vocab_size = self.layers.max_len, self.layers.vocab_size
    self.mesh = mesh_of(self._values)
    self.batch_axis = self.head_axis = UNSHARDED
    if self.mesh is not None:
      if batch_axis in self.mesh.dim_names:
        self.batch_axis = batch_axis
      wk = self._values[f'{self.layers.blocks[0][0]}/attn/wk']
      heads = (fsdp.use_layout(wk) or wk.layout).sharding_specs[1]
      self.head_axis = heads if heads != self.batch_axis else UNSHARDED
    self._functions: dict = {}

  # -- the public entry points ----------------------------------------------------------
  def logits(self, tokens):
    """[B, T, V] float32 logits of `tokens` [B, T] int32: the model's own
    forward pass (no dropout). Traced into a caller's function, or run eagerly
    (a host tensor comes back)."""
    if tf.inside_function():
      return self._logits(tokens)
    tokens = self._host_ids(tokens, 'tokens')
    check_fits(prompt_length=tokens.shape[1], max_new_tokens=1, max_len=self.max_len,
               where='the tokens')
    rows = tokens.shape[0]
    function = self._function(('logits',), self._logits)
    out = function(self._place(self._pad_rows(tokens, 0), self.batch_axis, UNSHARDED))
    return tf.constant(to_numpy(out)[:rows])

  def generate(self, prompts, lengths, *, max_new_tokens: int,
               sampling: Sampling = Sampling(), seed=0, stop_ids: Sequence[int] = (),
               first_row=0, stop_sequences: Sequence[Sequence[int]] = ()):
    """Each row's `max_new_tokens` new tokens, int32 [B, max_new_tokens], with
    the cache (module doc).

    Args:
      prompts: int32 [B, P], each row's prompt right-padded (any valid id).
      lengths: int32 [B], each prompt's length, 1..P.
      max_new_tokens: New tokens per row (>= 1); P + max_new_tokens - 1 must
        not exceed the model's max_len.
      sampling: How each token is picked (`Sampling()`: greedy).
      seed: An integer (Python or scalar tensor): the samples are a function
        of (seed, row, position), the same on any mesh.
      stop_ids: Token ids that end a row: the stop id is its last token, the
        positions after it hold DONE (-1); when every row has stopped the
        loop ends early.
      first_row: The index of row 0 in the whole batch (an integer, Python or
        scalar tensor), when a larger batch is decoded in parts: row r draws
        the samples of row first_row + r.
      stop_sequences: Token id sequences that end a row when its new tokens
        end with one (`layout_core.infer.stops.ends_with`).
    """
    return self._generate_entry(prompts, lengths, max_new_tokens=max_new_tokens,
                                sampling=sampling, seed=seed, stop_ids=stop_ids, cached=True,
                                stop_sequences=stop_sequences, first_row=first_row)

  def generate_by_recomputing(self, prompts, lengths, *, max_new_tokens: int,
                              sampling: Sampling = Sampling(), seed=0,
                              stop_ids: Sequence[int] = (), first_row=0,
                              stop_sequences: Sequence[Sequence[int]] = ()):
    """`generate` without the cache: every step runs the whole window again
    (the reference the cached path is tested against; slower)."""
    return self._generate_entry(prompts, lengths, max_new_tokens=max_new_tokens,
                                sampling=sampling, seed=seed, stop_ids=stop_ids, cached=False,
                                stop_sequences=stop_sequences, first_row=first_row)

  def prefill(self, prompts, lengths, *, max_new_tokens: int):
    """Traceable: what `generate` starts from. The prompts run through the
    model once; returns (per block (keys, values), each [B, P +
    max_new_tokens - 1, heads, head_dim] laid out as the cache is, the logits
    [B, V] at each row's last prompt token)."""
    prompts = self._lay(tf.cast(prompts, tf.int32), self.batch_axis)
    lengths = self._lay(tf.cast(lengths, tf.int32), self.batch_axis)
    return self._prefill(prompts, lengths, positions_needed(_size(prompts, 1), max_new_tokens))

  # -- calling: traced, or eagerly through a compiled function --------------------------
  def _generate_entry(self, prompts, lengths, *, max_new_tokens, sampling, seed, stop_ids,
                      stop_sequences, first_row, cached: bool):
    if not isinstance(sampling, Sampling):
      raise ConfigError(f'sampling is a {type(sampling).__name__}', where='sampling',
                        fix='give a layout_core.infer.sampling.Sampling')
    stop_ids, sequences = stops.checked(stop_ids, stop_sequences, vocab_size=self.vocab_size)
    settings = dict(max_new_tokens=max_new_tokens, sampling=sampling, stop_ids=stop_ids,
                    stop_sequences=sequences, cached=cached)
    if tf.inside_function():  # traced by the caller: shapes checked where they are known
      if prompts.shape[1] is not None:
        check_fits(prompt_length=prompts.shape[1], max_new_tokens=max_new_tokens,
                   max_len=self.max_len)
      return self._generate(prompts, lengths, seed, first_row, **settings)
    prompts, lengths = self._host_ids(prompts, 'prompts'), np.asarray(lengths, np.int32)
    width = prompts.shape[1]
    check_fits(prompt_length=width, max_new_tokens=max_new_tokens, max_len=self.max_len)
    if lengths.shape != prompts.shape[:1] or lengths.min() < 1 or lengths.max() > width:
      raise ConfigError(f'lengths {lengths.tolist()} do not fit prompts of shape '
                        f'{list(prompts.shape)}', where='lengths',
                        fix='give one length per row, each in 1..the prompts\' width')
    rows = prompts.shape[0]
    # Seed, first row (and the mesh loop's step) as one input long enough that
    # DTensor does not fold its value into the compile cache key
    # (`layout_core.layout.mesh.UNFOLDED_LENGTH`).
    numbers = np.zeros([UNFOLDED_LENGTH], np.int64)
    numbers[:3] = int(seed), int(first_row), 1
    inputs = (self._place(self._pad_rows(prompts, 0), self.batch_axis, UNSHARDED),
              self._place(self._pad_rows(lengths, 1), self.batch_axis),
              self._place(numbers, UNSHARDED))
    if self.mesh is not None:
      out = self._generate_on_mesh(*inputs, settings)
    else:
      out = self._function(('generate',) + tuple(sorted(settings.items())),
                           lambda p, n, s: self._generate(p, n, s[0], s[1], **settings))(*inputs)
    return tf.constant(to_numpy(out)[:rows])

  def _host_ids(self, ids, name: str) -> np.ndarray:
    ids = np.asarray(ids)
    if ids.ndim != 2 or ids.dtype.kind not in 'iu':
      raise ConfigError(f'{name} are {ids.dtype} of shape {list(ids.shape)}', where=name,
                        fix='give integer token ids [batch, length]')
    if ids.size and (ids.min() < 0 or ids.max() >= self.vocab_size):
      raise ConfigError(f'{name} hold ids from {ids.min()} to {ids.max()}, outside the '
                        f'model\'s {self.vocab_size}-token vocabulary', where=name,
                        fix=f'give ids in 0..{self.vocab_size - 1} (pad with 0)')
    return ids.astype(np.int32)

  def _function(self, key, fn):
    if key not in self._functions:
      self._functions[key] = tf.function(fn, autograph=False)
    return self._functions[key]

  def _pad_rows(self, array: np.ndarray, fill: int) -> np.ndarray:
    """`array` with idle rows of `fill` up to a multiple of the batch axis."""
    parts = 1 if self.batch_axis == UNSHARDED else mesh_axes(self.mesh)[self.batch_axis]
    missing = -array.shape[0] % parts
    return np.concatenate([array, np.full((missing, *array.shape[1:]), fill, array.dtype)])

  def _place(self, array: np.ndarray, *spec: str):
    """A host array as the compiled function takes it: on the mesh, split as
    `spec` says (the rest of its dimensions whole)."""
    if self.mesh is None:
      return tf.constant(array)
    spec = [*spec] + [UNSHARDED] * (array.ndim - len(spec))
    return pack_global_array(array, dtensor.Layout(spec, self.mesh))

  def _lay(self, x, *spec: str):
    """x relaid as `spec` says (its other dimensions whole) on the mesh; x itself without one."""
    if self.mesh is None:
      return x
    spec = [*spec] + [UNSHARDED] * (x.shape.rank - len(spec))
    return dtensor.relayout(x, dtensor.Layout(spec, self.mesh))

  def _lay_cache(self, x):
    return self._lay(x, self.batch_axis, UNSHARDED, self.head_axis, UNSHARDED)

  # -- the math ---------------------------------------------------------------------------
  def _weights(self, path: str, p: Params) -> TensorWeights:
    return TensorWeights(self._values, path, dtype=compute_dtype(p),
                         adapters=p.tuning.lora if p.tuning is not None else None)

  def _embed(self, ids, positions=None):
    path, p = self.layers.embedding
    if positions is None and ids.shape[1] is None:  # a traced caller's unknown length
      positions = tf.expand_dims(tf.range(tf.shape(ids)[1]), 0)
    scale = self._values.get(f'{path}/table{frozen.SCALE_SUFFIX}')  # an int8 table's
    return Embedding.lookup(p, ids, table=fsdp.at_use(self._values[f'{path}/table']),
                            table_scale=None if scale is None else fsdp.at_use(scale),
                            pos_table=(self._weights(path, p)('pos_table')
                                       if learned_positions(p) else None),
                            positions=positions, dtype=compute_dtype(p))

  def _block(self, index: int, x, attend_fn=None):
    path, p = self.layers.blocks[index]
    return TransformerBlock.apply_with(p, self._weights(path, p), x, attend_fn=attend_fn)

  def _head(self, x):
    """The final norm and the softmax projection: float32 logits."""
    (norm_path, norm), (softmax_path, softmax) = self.layers.final_norm, self.layers.softmax
    x = LayerNorm.apply(norm, self._weights(norm_path, norm), x)
    w = self._weights(softmax_path, softmax)
    b = w('b') if softmax.use_bias else None
    if softmax.tied_to:  # the embedding's table, as the trained model reads it
      table = self._values[Softmax.tied_path(softmax, softmax_path)]
      return Softmax.logits(x, table=tied_logits_table(table, compute_dtype(softmax)), b=b)
    return Softmax.logits(x, w=w('w'), b=b)

  def _hidden(self, tokens):
    x = self._embed(tokens)
    for index in range(len(self.layers.blocks)):
      x = self._block(index, x)
    return x

  def _logits(self, tokens):
    return self._head(self._hidden(tf.cast(tokens, tf.int32)))

  def _attention_parts(self, index: int):
    """(the attention's weights, its params, its head_dim) of block `index`."""
    path, p = self.layers.blocks[index]
    child = TransformerBlock.child_params(p)['attn']
    return (self._weights(path, p).child('attn'), child,
            MultiHeadAttention.head_dim(child))

  def _prefill(self, prompts, lengths, length):
    """The prompts through the model once: (each block's (keys, values) in
    caches of `length` positions, the logits at each row's last prompt token)."""
    width = _size(prompts, 1)
    caches = []
    x = self._embed(prompts)
    for index in range(len(self.layers.blocks)):
      w, p, head_dim = self._attention_parts(index)

      def attend_fn(h, w=w, p=p, head_dim=head_dim):
        q, k, v = attention_inputs(p, h, w)
        mask = causal_mask(width, dtype=q.dtype, window=p.sliding_window)
        out = attention_output(
            p, attend(q, k, v, mask=mask, head_dim=head_dim, dtype=h.dtype), w)
        pad = [[0, 0], [0, length - width], [0, 0], [0, 0]]
        caches.append((self._lay_cache(tf.pad(k, pad)), self._lay_cache(tf.pad(v, pad))))
        return out
      x = self._block(index, x, attend_fn)
    return caches, tf.squeeze(self._head(_select(x, lengths - 1)), 1)

  def _cached_step(self, caches, tokens, positions):
    """`tokens` [B] fed at `positions` [B]: (their logits [B, V], the caches
    with their keys and values written in)."""
    x = self._embed(tf.expand_dims(tokens, 1), positions=tf.expand_dims(positions, 1))
    length = _size(caches[0][0], 1)
    written = tf.reshape(_one_hot(positions, length), [-1, length, 1, 1])     # [B, L, 1, 1]
    keys_at, query_at = tf.expand_dims(tf.range(length), 0), tf.expand_dims(positions, 1)
    visible = keys_at <= query_at  # [B, L]
    updated = []
    for index, (keys, values) in enumerate(caches):
      w, p, head_dim = self._attention_parts(index)

      def attend_fn(h, w=w, p=p, head_dim=head_dim, keys=keys, values=values):
        q, k, v = attention_inputs(p, h, w, positions=tf.expand_dims(positions, 1))  # [B, 1, H, K]
        keys = self._lay_cache(tf.where(written, k, keys))
        values = self._lay_cache(tf.where(written, v, values))
        updated.append((keys, values))
        seen = visible if not p.sliding_window else tf.logical_and(  # causal_mask's window
            visible, keys_at > query_at - p.sliding_window)
        mask = tf.reshape(tf.cast(seen, q.dtype), [-1, 1, 1, length])  # [B, 1, 1, L]
        return attention_output(
            p, attend(q, keys, values, mask=mask, head_dim=head_dim, dtype=h.dtype), w)
      x = self._block(index, x, attend_fn)
    return tf.squeeze(self._head(x), 1), updated

  def _recomputed_step(self, window, tokens, positions):
    """`tokens` written into `window` [B, L] at `positions`, then the whole
    window run again: (the logits at `positions`, the window)."""
    written = _one_hot(positions, _size(window, 1))
    window = self._lay(tf.where(written, tf.expand_dims(tokens, 1), window), self.batch_axis)
    return self._logits_at(window, positions), window

  def _logits_at(self, window, positions):
    return tf.squeeze(self._head(_select(self._hidden(window), positions)), 1)

  # The decoding loop: `_first` gives the loop's variables (step, last
  # tokens, done, out, state) after the first token, `_next` moves them one
  # token on. `_generate` runs them as one tf.while_loop; on a mesh an eager
  # call runs them as two compiled functions, `_next` once per token.
  def _generate(self, prompts, lengths, seed, first_row, **settings):
    """The decoding loop, traceable (see `generate`)."""
    lengths = self._lay(tf.cast(lengths, tf.int32), self.batch_axis)
    loop = self._first(prompts, lengths, seed, first_row, **settings)
    steps = settings['max_new_tokens']

    def more(step, last, done, out, state):
      del last, out, state
      return tf.logical_and(step < steps, tf.logical_not(tf.reduce_all(done)))

    def body(*variables):
      return self._next(*variables, lengths, seed, first_row, **settings)
    # A name per trace, for reading graphs. It does not avoid TF 2.21's
    # "Cannot add function 'decode_0_body'" on a second traced decoder on a
    # mesh, which is why a mesh decodes step by step (_generate_on_mesh;
    # bench/limits/dtensor_while_loop_limit.py isolates it).
    return tf.while_loop(more, body, loop, name=f'decode_{next(_LOOP_NUMBERS)}')[3]

  def _first(self, prompts, lengths, seed, first_row, *, max_new_tokens: int,
             sampling: Sampling, stop_ids: tuple[int, ...], stop_sequences: tuple, cached: bool):
    """The prefill (or the first window) and the first new token: the
    loop's variables (step 1, last tokens, done, out [B, N], state)."""
    prompts = self._lay(tf.cast(prompts, tf.int32), self.batch_axis)
    if cached:
      state, logits = self._prefill(prompts, lengths,
                                    positions_needed(_size(prompts, 1), max_new_tokens))
    else:
      state = self._lay(tf.pad(prompts, [[0, 0], [0, max_new_tokens - 1]]), self.batch_axis)
      logits = self._logits_at(state, lengths - 1)
    first, done = self._pick(logits, lengths, tf.zeros_like(lengths) > 0, seed=seed,
                             first_row=first_row, sampling=sampling, stop_ids=stop_ids)
    del stop_sequences  # two tokens or more: none can end at the first
    columns = tf.expand_dims(tf.range(max_new_tokens), 0)
    out = tf.where(tf.equal(columns, 0), tf.expand_dims(first, 1), tf.ones_like(columns) * DONE)
    return (tf.constant(1), self._lay(first, self.batch_axis), self._lay(done, self.batch_axis),
            self._lay(out, self.batch_axis), state)

  def _next(self, step, last, done, out, state, lengths, seed, first_row, *,
            max_new_tokens: int, sampling: Sampling, stop_ids: tuple[int, ...],
            stop_sequences: tuple, cached: bool):
    """The loop's variables one token on: `last` fed at each row's next position."""
    advance = self._cached_step if cached else self._recomputed_step
    fed = tf.maximum(last, 0)  # a finished row feeds anything: its tokens are DONE
    logits, state = advance(state, fed, lengths + step - 1)
    token, stopped = self._pick(logits, lengths + step, done, seed=seed, first_row=first_row,
                                sampling=sampling, stop_ids=stop_ids)
    columns = tf.expand_dims(tf.range(max_new_tokens), 0)
    out = tf.where(tf.equal(columns, step), tf.expand_dims(token, 1), out)
    if stop_sequences:
      stopped = tf.logical_or(stopped, stops.ends_with(out, step, stop_sequences))
    return (step + 1, self._lay(token, self.batch_axis), self._lay(stopped, self.batch_axis),
            self._lay(out, self.batch_axis), state)

  def _pick(self, logits, positions, done, *, seed, first_row, sampling: Sampling,
            stop_ids: tuple[int, ...]):
    """(each row's next token, DONE for rows already done; whether the row is done now)."""
    rows = self._lay(tf.range(_size(logits, 0), dtype=tf.int64)
                     + tf.cast(first_row, tf.int64), self.batch_axis)
    token = sample(self._lay(logits, self.batch_axis), sampling=sampling, seed=seed, rows=rows,
                   positions=positions)
    token = tf.where(done, tf.ones_like(token) * DONE, token)
    # Computed from the token, never `done` passed on as it is: relaying out
    # a loop variable that the body returns unchanged crashes TF 2.21 on a
    # mesh (segmentation fault; bench/limits/dtensor_while_loop_limit.py).
    stopped = tf.equal(token, DONE)
    for stop in stop_ids:
      stopped = tf.logical_or(stopped, tf.equal(token, stop))
    return token, stopped

  def _generate_on_mesh(self, prompts, lengths, numbers, settings):
    """`_generate` eagerly on the mesh: `_first`, then `_next` once per new
    token, each a compiled function, the loop's variables staying on the
    devices. Not one while loop: a second traced function holding a DTensor
    while loop (another prompt width, another decoder) failed with "Cannot
    add function 'decode_0_body' because a different function with the same
    name already exists" (TF 2.21). `numbers` holds [seed, first_row, step]."""
    key = tuple(sorted(settings.items()))
    first = self._function(('first',) + key,
                           lambda p, n, s: self._first(p, n, s[0], s[1], **settings)[1:])

    def after(s, last, done, out, state, n):
      moved = self._next(tf.cast(s[2], tf.int32), last, done, out, state, n, s[0], s[1],
                         **settings)
      return (s + tf.one_hot(2, UNFOLDED_LENGTH, dtype=s.dtype),) + moved[1:]
    step_function = self._function(('next',) + key, after)
    last, done, out, state = first(prompts, lengths, numbers)
    for step in range(1, settings['max_new_tokens']):
      stopping = settings['stop_ids'] or settings['stop_sequences']
      if stopping and step % 8 == 0 and to_numpy(done).all():
        break  # every row has stopped (looked at every 8 tokens: a wait for the devices)
      numbers, last, done, out, state = step_function(numbers, last, done, out, state, lengths)
    return out
