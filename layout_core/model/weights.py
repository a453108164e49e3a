"""The weights a layer's math reads: one interface for a layer and for stacked cells.

A layer writes its math once, as `apply(cls, p, w, *inputs)` over a `Weights`
w: `w('w_in')` a weight as the math uses it, `w.child('ffn')` a sub-layer's,
`w.dense` / `w.project` its contractions, `w.random()` its dropout inputs.
Two kinds of `Weights` feed it:

  * `LayerWeights`: a built layer's own variables (`BaseLayer.fprop`);
  * `layout_core.pipeline.spmd.SlotWeights`: the SPMD pipeline's stage slots,
    each holding another cell's weights (every tensor with a lead dim 's').

Both carry the step's context (`w.context`, a `layout_core.step_context`
`StepContext`: dropout's random state, packed segments, the residual pin,
FSDP's batch split, remat), read once where the weights are made, so a
layer's math receives it rather than looking it up.

Both reach FSDP's gather at use through one `GatheredAtUse`: the first split
weight read gathers every split weight of the layer (or cell) being run at
once, a few collectives for the whole block, and the reads after it share
the gathered copies. Inside a rematerialized layer the gathers wait for the
layer's inputs (`after`), so a recomputation gathers again only when it is
reached.

    w = LayerWeights(layer, inputs=(x,))   # in a layer's fprop
    y = w.dense(x, 'w_in')                 # x @ w_in, gathered first under FSDP
"""

from __future__ import annotations

from typing import Callable, Hashable, Mapping, NamedTuple

from layout_core.lazy import tf
from layout_core.layout import fsdp
from layout_core.layout.variables import path_seed
from layout_core.model import frozen, lora
from layout_core.model.random import DropoutInputs
from layout_core.step_context import StepContext, current


def dense(x: tf.Tensor, w: tf.Tensor, *, lead: str = '') -> tf.Tensor:
  """x[..., d] @ w[d, f]: a matmul for 2-D x (on CPU the einsum kernel's
  forward + backward took 2x as long at [16, 1024] x [1024, 1024]), else an
  einsum with explicit letters (DTensor's einsum has no '...' broadcasting).
  With lead 's': per slot, x[s, ..., d] @ w[s, d, f].

  A layer's `fprop` uses it for its weights: `dense(x, self.weight('w'))`.
  """
  if lead:
    return tf.einsum(fsdp.lead_equation(dense_equation(x.shape.rank - len(lead)), lead), x, w)
  if x.shape.rank == 2:
    return tf.matmul(x, w)
  return tf.einsum(dense_equation(x.shape.rank), x, w)


def dense_equation(rank: int) -> str:
  """`dense`'s einsum for x of `rank` (no lead)."""
  batch = 'abceghij'[:rank - 1]
  return f'{batch}d,df->{batch}f'


def as_used(variable, dtype=None) -> tf.Tensor:
  """`variable` as the math uses it: gathered when FSDP stores it split
  (`fsdp.at_use`), cast to `dtype` (None: as stored, float32 for int8), times
  its scale where it is stored in int8 (`layout_core.model.frozen`)."""
  scale = frozen.scale_of(variable)
  if scale is None:
    return fsdp.at_use(variable, dtype)
  dtype = dtype or 'float32'
  return fsdp.at_use(variable, dtype) * fsdp.at_use(scale, dtype)


def cast(x, dtype) -> tf.Tensor:
  """x as `dtype`; x itself (a variable is then read by its consumer, as
  before compute dtypes existed) when it already has it."""
  return x if x.dtype == tf.as_dtype(dtype) else tf.cast(x, dtype)


class Split(NamedTuple):
  """A weight FSDP stores split: its value (a variable, or a stacked cell's
  [S, ...] rows), stored and use layouts, the compute dtype, and whether a
  contraction uses it per replica instead (`fsdp.replica_axis`), in which
  case the group's gather leaves it out unless it is read directly."""
  value: object
  stored: object
  use: object
  dtype: str | None
  per_replica: bool = False


class GatheredAtUse:
  """FSDP's gather at use for one layer call (or one stacked cell): `splits()`
  lists the group's split weights by key; `get(key)` gathers, on its first
  call, every one not yet gathered (but for per-replica matrices other than
  `key`) in one `fsdp.gather_all`, after the tensors `after`."""

  def __init__(self, splits: Callable[[], Mapping[Hashable, Split]], after: tuple = ()):
    self._splits, self._after = splits, after
    self._values: dict = {}

  def get(self, key: Hashable):
    if key not in self._values:
      pending = {k: s for k, s in self._splits().items()
                 if k not in self._values and (k == key or not s.per_replica)}
      with tf.control_dependencies(self._after):
        gathered = fsdp.gather_all([s.value for s in pending.values()],
                                   to=[s.use for s in pending.values()],
                                   stored=[s.stored for s in pending.values()],
                                   dtypes=[s.dtype for s in pending.values()])
      self._values.update(zip(pending, gathered))
    return self._values[key]

  def once(self, key: Hashable, make: Callable[[], object], wait: bool = False):
    """`make()` once per group (after `after` if `wait`): a weight per replica,
    or an input's rows, shared by the sub-layers."""
    if key not in self._values:
      with tf.control_dependencies(self._after if wait else ()):
        self._values[key] = make()
    return self._values[key]


def waits_for(inputs, context: StepContext) -> tuple:
  """What a layer's gathers wait for: its tensor inputs inside a rematerialized
  layer (`context.remat`), else nothing.

  A gather depends on nothing but variables, and the executor may run an op
  as soon as its inputs are ready. Inside a rematerialized layer, whose
  gathered copies are dropped after use, the gathers wait for the inputs (a
  width-1792 bf16 + remat LM's gradients function peaked at 4.00 GiB with the
  wait, 4.09 without). Elsewhere the backward keeps every gathered copy
  anyway, and the wait only stalled the math behind each gather (float32
  FSDP, width 1472, 3 steps: peak RSS 4.02 GiB with it, 3.80 without)."""
  return tuple(x for x in inputs if tf.is_tensor(x)) if context.remat else ()


class Weights:
  """A layer's weights as its `apply` reads them (module doc).

  `lead` names leading dimensions every weight and activation carries: ''
  for a layer's own variables, 's' for the SPMD pipeline's stage slots. The
  broadcasting helpers make one body of math serve both. `context` is the
  step's (`layout_core.step_context`).

      @classmethod
      def apply(cls, p, w, x):                  # x [b, t, d]
        norm = cls.child_params(p)['ln']
        x = norm.cls.apply(norm, w.child('ln'), x)   # a sub-layer, on its weights
        h = w.dense(x, 'w_in') + w.vector('b_in', x)  # x @ w_in + b_in
        return w.project('btd,dhk->bthk', h, 'wq')   # any contraction with a weight
  """
  lead = ''
  """Leading dimensions of every weight and activation: '' for a layer's own
  variables, 's' for the SPMD pipeline's stage slots."""
  dtype = None
  """The compute dtype weights are cast to (None: as stored)."""
  context = StepContext()
  """The step's `StepContext` (dropout state, packed segments, ...): read
  `w.context.sequence`, not `layout_core.step_context.current()`."""

  def __call__(self, name: str) -> tf.Tensor:
    """Weight `name` as the math uses it: in the compute dtype, gathered
    first when FSDP stores it split, times its scale where it is stored in
    int8 (`layout_core.model.frozen`). `w('w')`."""
    value = self._read(name)
    if self.has(name + frozen.SCALE_SUFFIX):
      value = value * self._read(name + frozen.SCALE_SUFFIX)
    return value

  def _read(self, name: str) -> tf.Tensor:
    """Variable `name` in the compute dtype, gathered when FSDP stores it split."""
    raise NotImplementedError

  def _stored(self, name: str) -> tf.Tensor:
    """Variable `name` as stored (no cast, no gather)."""
    raise NotImplementedError

  def _recomputed(self, name: str) -> bool:
    """Whether contractions with weight `name` make it again in the backward
    pass instead of keeping it: a frozen weight, not split by FSDP, stored in
    another dtype than the math's (bfloat16 or int8 under float32 math, a
    float32 one under bfloat16 math)."""
    return False

  path = ''
  """The layer's variable path ('lm/stack/block_000/moe'; '' for stacked cells)."""

  def layout(self, name: str):
    """The layout weight `name`'s math uses (its gathered one under FSDP);
    None where it has none of its own (stacked cells)."""
    return None

  def child(self, name: str) -> 'Weights':
    """The weights of sub-layer `name` (a key of `child_params`), sharing
    this layer's context and FSDP gather."""
    raise NotImplementedError

  def random(self) -> DropoutInputs | None:
    """None outside a training step (evaluation): random layers are the identity.

    In a training step, what this layer's dropout mask is drawn from (the
    step seed, a key from the layer's path, the batch's first row), for
    `layout_core.model.random.dropout(x, rate=..., inputs=w.random(),
    lead=w.lead)`: the same mask however the batch and the model are split.
    """
    raise NotImplementedError

  adapters = None
  """The model's `layout_core.model.lora.LoraConfig` (None: no adapters):
  `dense` and `project` add the low-rank path of a weight that has them."""

  def has(self, name: str) -> bool:
    """Whether there is a weight `name` (a LoRA adapter, say)."""
    raise NotImplementedError

  def dense(self, x: tf.Tensor, name: str) -> tf.Tensor:
    """x[..., d] @ w[d, f] with weight `name` (per slot under a lead), plus
    its adapters' low-rank path where it has them (`layout_core.model.lora`)."""
    if self._recomputed(name):
      y = self._recomputing(lambda x, w: dense(x, w, lead=self.lead), x, name)
    else:
      y = self._dense(x, name)
    if self._adapted(name):
      y += lora.low_rank(self, dense_equation(x.shape.rank - len(self.lead)), x, name,
                         self.adapters)
    return y

  def project(self, equation: str, x: tf.Tensor, name: str) -> tf.Tensor:
    """`tf.einsum(equation, x, self(name))`, each operand's subscripts
    after the lead ones ('btd,dhk->bthk'), plus the adapters' path."""
    if self._recomputed(name):
      lead = fsdp.lead_equation(equation, self.lead)
      y = self._recomputing(lambda x, w: tf.einsum(lead, x, w), x, name)
    else:
      y = self._project(equation, x, name)
    if self._adapted(name):
      y += lora.low_rank(self, equation, x, name, self.adapters)
    return y

  def _recomputing(self, contract, x, name: str) -> tf.Tensor:
    """contract(x, w(name)), the weight made again from its stored parts in
    the backward pass (`frozen.recomputed_contraction`)."""
    names = [name] + [n for n in (name + frozen.SCALE_SUFFIX,) if self.has(n)]
    dtype = self.dtype

    def weight_of(stored, scale=None):
      value = cast(stored, dtype)
      return value if scale is None else value * cast(scale, dtype)
    return frozen.recomputed_contraction(contract, x, [self._stored(n) for n in names],
                                         weight_of)

  def _adapted(self, name: str) -> bool:
    return (self.adapters is not None and self.context.adapters
            and self.has(name + lora.A_SUFFIX))

  def _dense(self, x, name):
    return dense(x, self(name), lead=self.lead)

  def _project(self, equation, x, name):
    return tf.einsum(fsdp.lead_equation(equation, self.lead), x, self(name))

  def vector(self, name: str, x: tf.Tensor) -> tf.Tensor:
    """A weight matching x's trailing dimensions, [n] or [h, k] (per slot
    [S, n], [S, h, k]), ready to combine with x [..., n] or [..., h, k]."""
    w = self(name)
    if self.lead:
      for _ in range(x.shape.rank - w.shape.rank):
        w = tf.expand_dims(w, 1)
    return w


class LayerWeights(Weights):
  """A built layer's own variables (lead ''), gathered at use under FSDP for
  the whole layer being run (its sub-layers share the group; their gathers
  wait for `inputs` inside a rematerialized layer). Where the step splits
  the batch over FSDP's axis and the math is narrower than the weights, the
  matrices its contractions use (`dense`, `project`) are used per replica
  instead (`fsdp.per_replica`), each once per layer call. `context`: the
  step context in force (default: `current()`)."""

  def __init__(self, layer, *, inputs: tuple = (), context: StepContext | None = None,
               at_use: GatheredAtUse | None = None):
    self.layer = layer
    self.dtype = layer.compute_dtype
    self.context = current() if context is None else context
    self._at_use = at_use or GatheredAtUse(
        lambda: _layer_splits(layer, self.context.batch_split),
        waits_for(inputs, self.context))
    tuning = layer.params.tuning
    self.adapters = None if tuning is None else tuning.lora

  def has(self, name):
    return name in self.layer.variable_names

  @property
  def path(self) -> str:
    return self.layer.path

  def layout(self, name):
    variable = getattr(self.layer, name)
    return fsdp.use_layout(variable) or getattr(variable, 'layout', None)

  def _read(self, name):
    variable = getattr(self.layer, name)
    if fsdp.use_layout(variable) is None:
      return cast(variable, self.dtype)
    return self._at_use.get(id(variable))

  def _stored(self, name):
    return tf.convert_to_tensor(getattr(self.layer, name))

  def _recomputed(self, name):
    variable = getattr(self.layer, name)
    return (not variable.trainable and fsdp.use_layout(variable) is None
            and (variable.dtype != tf.as_dtype(self.dtype)
                 or self.has(name + frozen.SCALE_SUFFIX)))

  def _replica_axis(self, variable) -> str | None:
    return fsdp.replica_axis(variable, self.dtype, self.context.batch_split)

  def _dense(self, x, name):
    variable = getattr(self.layer, name)
    if self._replica_axis(variable) is None or x.shape.rank < 2:
      return super()._dense(x, name)
    return self._project(dense_equation(x.shape.rank), x, name)

  def _project(self, equation, x, name):
    variable = getattr(self.layer, name)
    axis = self._replica_axis(variable)
    if axis is None:
      return super()._project(equation, x, name)
    # An input's rows made once, so the projections of one input (attention's
    # q, k, v) sum their gradients in one place, in the order a run without
    # FSDP does.
    replicas = self._at_use.once(('replicas', id(variable)),
                                 lambda: fsdp.per_replica(variable, self.dtype, axis=axis),
                                 wait=True)
    rows = self._at_use.once(('rows', id(x)),
                             lambda: (x, fsdp.as_rows(x, replicas.shape[0])))[1]
    return fsdp.replica_einsum(equation, rows, variable, replicas, axis=axis)

  def child(self, name):
    return LayerWeights(getattr(self.layer, name), context=self.context, at_use=self._at_use)

  def random(self):
    state = self.context.random
    if state is None:
      return None
    return DropoutInputs(seed=state.seed, keys=path_seed(self.layer.path, 0),
                         first_rows=state.batch_offset)


def _layer_splits(layer, batch_split: str | None) -> dict:
  """id(variable) -> Split for every split weight of `layer` and its sub-layers."""
  return {id(v): Split(v, v.layout, fsdp.use_layout(v), dtype,
                       per_replica=fsdp.replica_axis(v, dtype, batch_split) is not None)
          for v, dtype in layer.split_weights()}
