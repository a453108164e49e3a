"""Mixture of experts: a routed feed-forward layer, split over an expert axis.

    p = MoEFeedForward.Params().Set(input_dim=64, hidden_dim=128, num_experts=8,
                                    experts_per_token=2)
    with collecting() as terms:                 # the engine, around the forward pass
      y = model(x)                              # each MoE layer adds its router terms
    loss, metrics = terms.added_to(loss, metrics)   # aux and z losses, load, drops

Each token's router picks `experts_per_token` (k) of `num_experts` (E)
experts; the token goes to each, and their outputs come back weighted by the
router's probabilities (renormalised over the k, Mixtral, or not,
Qwen2-MoE). Dispatch and combine are GShard's einsums, in groups of one
batch row: a token's place in its expert's buffer (capacity C per expert and
group) is counted inside its own row, where the row lives, so no device
needs another's tokens to know it. Every first choice of a row comes before
any second choice; a choice past the capacity is dropped, and a token all of
whose choices are dropped leaves the layer as zero (the block's residual
carries it unchanged). `capacity_factor` <= 0 keeps every token (C = the
row's length).

The experts' weights are [E, ...]: a layout rule splits dim 0 over a mesh
axis (expert parallelism). The tokens then move to their expert's device
and back by relayouts of the [rows, E, C, D] buffers: an all-to-all where the
expert axis is the batch's own (GShard), a local slice and a sum across the
expert axis where they differ (`bench/moe_exchange.py` measures which).

The router's terms, per MoE layer and step: the load-balancing loss
E * sum_e f_e P_e (f_e: the share of tokens among whose k choices e is, so
sum_e f_e = k; P_e: the mean router probability of e; Switch and GShard's
form, Hugging Face's Mixtral), the router z-loss (the mean over tokens of
logsumexp(logits)^2, ST-MoE), the share of choices each expert receives
(min and max over experts; 1/E each when balanced) and the share of choices
dropped. The losses are added to the training loss with their coefficients,
averaged over the MoE layers, and every term is logged (`added_to`).
"""

from __future__ import annotations

import contextlib
import math
from typing import Iterator, Mapping, NamedTuple

from layout_core.errors import ConfigError
from layout_core.lazy import dtensor, tf
from layout_core.layout.rules import UNSHARDED
from layout_core.layout.variables import Normal
from layout_core.model.base import BaseLayer, Declared, LayerMeta, leaf_layers, num_elements
from layout_core.model.layers import FeedForward, activate
from layout_core.params import Params
from layout_core.step_context import current, entered
from layout_core.tasks.objective import Mean

ROUTERS = ('softmax', 'sigmoid')


class RouterTerms(NamedTuple):
  """One MoE layer's router terms in one forward pass (float32 scalars): a
  tuple, so the sub-mesh pipeline can hand them from one step function to
  the next (`values`)."""
  aux_loss: tf.Tensor
  z_loss: tf.Tensor
  load_min: tf.Tensor
  load_max: tf.Tensor
  dropped: tf.Tensor
  penalty: tf.Tensor   # aux_loss_coef x aux_loss + z_loss_coef x z_loss


class CollectedTerms:
  """The router terms the MoE layers of one forward pass add (`collecting`),
  by the layer's path."""

  def __init__(self):
    self.layers: dict[str, RouterTerms] = {}

  def add(self, path: str, terms: RouterTerms) -> None:
    self.layers[path] = terms

  def extend(self, layers: Mapping[str, tuple]) -> 'CollectedTerms':
    """These terms and `layers` ({path: RouterTerms' values}, another
    stage's), in path order."""
    self.layers.update({path: RouterTerms(*values) for path, values in layers.items()})
    self.layers = dict(sorted(self.layers.items()))
    return self

  def penalty(self, num_layers: int | None = None):
    """The layers' penalties summed over `num_layers` (default: theirs): what
    the loss gets, averaged over the model's routed layers."""
    return tf.add_n([t.penalty for t in self.layers.values()]) / float(
        num_layers or len(self.layers))

  def added_to(self, loss, metrics: dict, num_layers: int | None = None) -> tuple:
    """(loss, metrics) with the layers' weighted aux and z losses (their mean
    over `num_layers`, default these) added to the loss, and the terms as
    metrics: `moe/aux_loss`, `moe/z_loss` (unweighted means over layers),
    per layer `moe/<layer>/load_min`, `load_max`, `dropped`. Unchanged with
    no terms. A `Mean` loss gets the penalty times its count
    (`weighted`)."""
    if not self.layers:
      return loss, metrics
    terms, n = list(self.layers.values()), float(len(self.layers))
    metrics = dict(metrics)
    metrics['moe/aux_loss'] = tf.add_n([t.aux_loss for t in terms]) / n
    metrics['moe/z_loss'] = tf.add_n([t.z_loss for t in terms]) / n
    for path, t in self.layers.items():
      name = layer_tag(path)
      metrics[f'moe/{name}/load_min'] = t.load_min
      metrics[f'moe/{name}/load_max'] = t.load_max
      metrics[f'moe/{name}/dropped'] = t.dropped
    return weighted(loss, self.penalty(num_layers)), metrics


def weighted(loss, penalty):
  """`loss` plus `penalty` (a mean over the loss's tokens): a `Mean` loss's
  total gets the penalty times its count, so the parts of a batch add it
  weighted as their tokens (`layout_core.tasks.objective`)."""
  if isinstance(loss, Mean):
    return Mean(loss.total + penalty * tf.cast(loss.count, penalty.dtype), loss.count)
  return loss + tf.cast(penalty, loss.dtype)


def layer_tag(path: str) -> str:
  """The TensorBoard name of an MoE layer at `path`: its block
  ('lm/stack/block_001/moe' -> 'block_001')."""
  parts = path.split('/')
  return parts[-2] if len(parts) > 1 else parts[-1]


@contextlib.contextmanager
def collecting() -> Iterator[CollectedTerms]:
  """A block in which MoE layers add their router terms to the one yielded."""
  terms = CollectedTerms()
  with entered(current().replace(router_terms=terms)):
    yield terms


def capacity(p, group_size: int) -> int:
  """Token slots per expert and group: ceil(capacity_factor * group_size * k / E),
  at most the group's size; every token's (the group's size) when the
  factor is <= 0."""
  if p.capacity_factor <= 0:
    return group_size
  slots = math.ceil(p.capacity_factor * group_size * p.experts_per_token / p.num_experts)
  return max(1, min(group_size, slots))


class BufferWork(NamedTuple):
  """What a routed layer runs for one batch, as executed (its buffer of
  E x C slots per row, filled or not), where `fprop_meta` counts the k
  active experts a token uses (FLOPs for MFU)."""
  active_flops: int       # the experts' matmuls a token's k choices need
  expert_flops: int       # the experts' matmuls over every slot
  route_flops: int        # the dispatch and combine einsums, on the rows
  buffer_elements: int    # of the [G, E, C, D] buffer: what an exchange moves
  active_slots: int       # token choices (G x S x k)
  slots: int              # buffer slots (G x E x C)


def buffer_work(p, x_shape) -> BufferWork:
  """The work of layer `p` on x of `x_shape` [G rows, S, D]."""
  rows, length = x_shape[0], num_elements(x_shape[1:-1])
  per_slot = 2 * p.input_dim * p.hidden_dim * len(MoEFeedForward.matrices(p))
  slots = rows * p.num_experts * capacity(p, length)
  active = rows * length * p.experts_per_token
  return BufferWork(active_flops=per_slot * active, expert_flops=per_slot * slots,
                    route_flops=2 * 2 * slots * p.input_dim * length,
                    buffer_elements=slots * p.input_dim, active_slots=active, slots=slots)


def slot_elementwise(p) -> int:
  """Elementwise FLOPs of one slot: its experts' activations and the output's weighting."""
  return len(MoEFeedForward.matrices(p)) * p.hidden_dim + p.input_dim


class Routing:
  """Where each token of [G, S] groups goes: `dispatch` [G, S, E, C] (1 where
  token s fills slot c of expert e), `combine` [G, S, E, C] (its router
  weight there), and the router's terms' inputs."""

  def __init__(self, logits, *, k: int, router: str, normalize: bool, slots: int):
    self.logits = logits                                 # [G, S, E] float32
    experts = logits.shape[-1]
    self.probs = tf.nn.softmax(logits) if router == 'softmax' else tf.sigmoid(logits)
    # The choices from top_k, their weights read back through the one-hots:
    # top_k's own gradient indexes the whole tensor, which fails where DTensor
    # splits the rows (bench/limits/moe_routing_limit.py).
    _, index = tf.math.top_k(tf.stop_gradient(self.probs), k)      # [G, S, k]
    self.choice = tf.one_hot(index, experts, dtype=tf.float32)   # [G, S, k, E]
    top = tf.einsum('gske,gse->gsk', self.choice, self.probs)
    if normalize:
      top = top / tf.reduce_sum(top, axis=-1, keepdims=True)
    # Slot of each choice in its expert's buffer: every token's first choice
    # (in token order), then every second one, ... counted within the group.
    order = tf.transpose(self.choice, [0, 2, 1, 3])                # [G, k, S, E]
    shape = tf.shape(order)
    flat = tf.reshape(order, [shape[0], -1, experts])
    before = tf.reshape(tf.cumsum(flat, axis=1, exclusive=True), shape)
    slot = tf.reduce_sum(tf.transpose(before, [0, 2, 1, 3]) * self.choice, axis=-1)  # [G, S, k]
    self.kept = tf.cast(slot < slots, tf.float32)                 # [G, S, k]
    in_slot = tf.one_hot(tf.cast(slot, tf.int32), slots, dtype=tf.float32)  # [G, S, k, C]
    self.dispatch = tf.einsum('gske,gskc->gsec', self.choice * self.kept[..., None], in_slot)
    self.combine = tf.einsum('gske,gskc->gsec',
                             self.choice * (top * self.kept)[..., None], in_slot)

  def terms(self, *, aux_coef: float, z_coef: float) -> RouterTerms:
    experts = self.logits.shape[-1]
    k = self.choice.shape[2]
    chosen = tf.reduce_sum(self.choice, axis=2)                   # [G, S, E]
    tokens_share = tf.reduce_mean(chosen, axis=[0, 1])            # f_e, sums to k
    # E * sum_e f_e P_e as a mean over tokens of E * sum_e f_e p_e(token) (the
    # mean over the group dims of [G, S, E] failed to compile its gradient's
    # Tile inside a sub-mesh pipeline stage; not isolated:
    # bench/limits/moe_routing_limit.py differentiates both forms)
    aux = experts * tf.reduce_mean(tf.einsum('gse,e->gs', self.probs,
                                             tf.stop_gradient(tokens_share)))
    z = tf.reduce_mean(tf.square(tf.reduce_logsumexp(self.logits, axis=-1)))
    load = tokens_share / k                                       # share of choices
    dropped = 1.0 - tf.reduce_mean(self.kept)
    return RouterTerms(aux_loss=aux, z_loss=z, load_min=tf.reduce_min(load),
                       load_max=tf.reduce_max(load), dropped=dropped,
                       penalty=aux_coef * aux + z_coef * z)


class MoEFeedForward(BaseLayer):
  """Routed feed-forward (module doc): x [B, T, D] -> sum over the token's k
  experts of weight * expert(x), plus a shared expert where `shared_dim`."""

  @classmethod
  def Params(cls):
    p = super().Params()
    p.name = 'moe'
    p.Define('input_dim', 64, 'Input and output width.')
    p.Define('hidden_dim', 256, 'Inner width of each expert.')
    p.Define('num_experts', 8, 'Experts (E).')
    p.Define('experts_per_token', 2, 'Experts each token goes to (top-k).')
    p.Define('router', 'softmax', "Router probabilities: 'softmax' or 'sigmoid'.")
    p.Define('normalize_top_k', True, 'Renormalise the k chosen weights to sum to 1 '
             '(Mixtral); False: the probabilities as they are (Qwen2-MoE).')
    p.Define('capacity_factor', 0.0, 'Slots per expert = capacity_factor * tokens * k / E '
             'per row; <= 0: no token dropped.')
    p.Define('kind', 'swiglu', "Each expert: 'mlp', 'swiglu' or 'geglu'.")
    p.Define('activation', 'relu', "Activation of kind 'mlp'.")
    p.Define('shared_dim', 0, 'Inner width of a shared expert every token goes '
             'through (Qwen2-MoE); 0: none.')
    p.Define('shared_gate', True, 'Scale the shared expert by sigmoid(x w_shared_gate).')
    p.Define('aux_loss_coef', 0.01, 'Weight of the load-balancing loss in the loss.')
    p.Define('z_loss_coef', 0.0, 'Weight of the router z-loss in the loss.')
    p.Define('init_stddev', 0.02, 'Stddev of the initial weights.')
    return p

  @classmethod
  def matrices(cls, p) -> tuple[str, ...]:
    return ('w_in', 'w_out') if p.kind == 'mlp' else ('w_gate', 'w_up', 'w_down')

  @classmethod
  def declare_variables(cls, p):
    init = Normal(p.init_stddev)
    e, d, h = p.num_experts, p.input_dim, p.hidden_dim
    declared = [Declared('router', (d, e), init, inputs=1, exact=True)]
    for name in cls.matrices(p):
      shape = (e, h, d) if name in ('w_out', 'w_down') else (e, d, h)
      declared.append(Declared(name, shape, init, inputs=1, lead=1))
    if p.shared_dim and p.shared_gate:
      declared.append(Declared('shared_gate', (d, 1), init, inputs=1))
    return declared

  @classmethod
  def child_params(cls, p):
    if not p.shared_dim:
      return {}
    return {'shared': FeedForward.Params().Set(
        name='shared', input_dim=p.input_dim, hidden_dim=p.shared_dim, kind=p.kind,
        activation=p.activation, use_bias=False, init_stddev=p.init_stddev)}

  @classmethod
  def stackable(cls, p) -> bool:
    return False  # its router terms leave the layer beside its output: not a pipeline cell

  @classmethod
  def fprop_meta(cls, p, x_shape):
    tokens = num_elements(x_shape[:-1])
    work = buffer_work(p, x_shape)
    matmul = work.active_flops + 2 * tokens * p.input_dim * p.num_experts  # + the router
    flops = matmul + work.active_slots * slot_elementwise(p)
    for child in cls.child_params(p).values():
      meta = child.cls.fprop_meta(child, x_shape)
      matmul += meta.matmul_flops
      flops += meta.flops
    return LayerMeta(out_shapes=(tuple(x_shape),), flops=flops, matmul_flops=matmul)

  @classmethod
  def apply(cls, p, w, x):
    slots = capacity(p, x.shape[1])
    expert_axis, batch_axis, mesh = _axes(w, cls.matrices(p)[0])
    rows = [batch_axis or UNSHARDED]  # the routing stays with its rows (pinned: under
    # remat DTensor otherwise gathered a reduction's result, and failed to compile)
    logits = _relayout(tf.cast(w.project('btd,de->bte', x, 'router'), tf.float32), mesh, rows)
    routing = Routing(logits, k=p.experts_per_token, router=p.router,
                      normalize=p.normalize_top_k, slots=slots)
    sink = w.context.router_terms
    if sink is not None:
      sink.add(w.path, routing.terms(aux_coef=p.aux_loss_coef, z_coef=p.z_loss_coef))
    dispatch = _relayout(tf.cast(routing.dispatch, x.dtype), mesh, rows)
    # The buffer [G, E, C, D] keeps the rows first, as every activation does:
    # dropout's masks (a LoRA adapter's, here) follow the rows however the
    # batch is cut.
    h = tf.einsum('gsec,gsd->gecd', dispatch, x)
    h = _relayout(h, mesh, [_other(batch_axis, expert_axis), expert_axis])
    if p.kind == 'mlp':
      h = activate(w.project('gecd,edh->gech', h, 'w_in'), p.activation)
      out = w.project('gech,ehd->gecd', h, 'w_out')
    else:
      gate = activate(w.project('gecd,edh->gech', h, 'w_gate'),
                      'silu' if p.kind == 'swiglu' else 'gelu_tanh')
      out = w.project('gech,ehd->gecd', gate * w.project('gecd,edh->gech', h, 'w_up'),
                      'w_down')
    if expert_axis != UNSHARDED and expert_axis == batch_axis:
      out = _relayout(out, mesh, [batch_axis, UNSHARDED])          # GShard: back by all-to-all
    combine = _relayout(tf.cast(routing.combine, out.dtype), mesh, rows)
    y = _relayout(tf.einsum('gsec,gecd->gsd', combine, out), mesh, rows)
    if p.shared_dim:
      shared_p = cls.child_params(p)['shared']
      shared = shared_p.cls.apply(shared_p, w.child('shared'), x)
      if p.shared_gate:
        shared *= tf.sigmoid(w.dense(x, 'shared_gate'))
      y += shared
    return y


def _other(batch_axis: str | None, expert_axis: str) -> str:
  return batch_axis if batch_axis and batch_axis != expert_axis else UNSHARDED


def _axes(w, name: str):
  """(the mesh axis splitting weight `name`'s experts, the batch's, the mesh)."""
  layout = w.layout(name)
  if layout is None:
    return UNSHARDED, w.context.batch_split, None
  return layout.sharding_specs[0], w.context.batch_split, layout.mesh


def _relayout(x, mesh, lead: list[str]):
  """x relaid to `lead` on its leading dims, whole elsewhere (no mesh: as is)."""
  if mesh is None or all(a == UNSHARDED for a in lead):
    return x
  return dtensor.relayout(x, dtensor.Layout(lead + [UNSHARDED] * (x.shape.rank - len(lead)),
                                            mesh))


def routed_child(p):
  """The routed layer of leaf layer `p`: itself, a Transformer block's
  'moe' child, or None (a dense layer)."""
  if p.cls is MoEFeedForward:
    return p
  if getattr(p, 'moe', None) is not None:
    return p.cls.child_params(p)['moe']
  return None


def is_expert_weight(path: str) -> bool:
  """A routed layer's expert weight ([E, ...], split where the experts are)."""
  return '/moe/w_' in path


def _routed(params):
  """(block path, MoEFeedForward params) of every routed layer of a Params model."""
  if not isinstance(params, Params):
    return
  for path, p in leaf_layers(params):
    routed = routed_child(p)
    if routed is not None:
      yield path, routed


def routed_layers(params) -> list:
  """The MoEFeedForward params of every routed layer of a Params model."""
  return [p for _, p in _routed(params)]


def inactive_parameters(params) -> int:
  """Parameters a token does not use: in each routed layer, the experts it
  is not sent to ((E - k) / E of the experts' weights)."""
  return sum((p.num_experts - p.experts_per_token) * p.input_dim * p.hidden_dim
             * len(MoEFeedForward.matrices(p)) for p in routed_layers(params))


def check_supported(params, *, engine: str | None) -> None:
  """A ConfigError where a run cannot route: the SPMD pipeline (`engine`
  'spmd'; None: no pipeline), whose stacked cells carry no router terms out
  of their stage slots. The sub-mesh engine carries them (`GPipe`)."""
  routed = [path for path, _ in _routed(params)]
  if routed and engine == 'spmd':
    raise ConfigError(
        f"the SPMD pipeline (pipeline.engine = 'spmd') cannot run mixture-of-experts layers "
        f'({len(routed)} routed blocks, the first {routed[0]!r})',
        where="pipeline.engine = 'spmd' with transformer_lm.moe",
        fix="use pipeline.engine = 'submesh', or no pipeline and the experts split over a "
            'mesh axis (configs/layouts/moe_expert.gin)')


def check_submesh_layouts(records, *, batch_axis: str) -> None:
  """A ConfigError where the sub-mesh pipeline's stages would split experts
  over an axis other than the batch's: its stages do not pin the rows'
  layout (no `batch_split` in their context), and without the pin DTensor
  (TF 2.21) could not compile the combine's backward (EmitAllScatter); on
  the batch's own axis (GShard) it trains as one device does."""
  other = [r for r in records if is_expert_weight(r.path) and r.spec
           and (r.use_spec or r.spec)[0] not in (UNSHARDED, batch_axis)]
  if other:
    first = other[0]
    raise ConfigError(
        f'the sub-mesh pipeline cannot split experts over {(first.use_spec or first.spec)[0]!r}, '
        f"an axis other than the batch's ({batch_axis!r}): {first.path} by {first.source}",
        where='layout_rules.rules with pipeline.engine = \'submesh\'',
        fix=f"split the experts over the batch axis in each stage, e.g. (r'.*/moe/w_.*', "
            f"('{batch_axis}', 'unsharded', 'unsharded')), or train without a pipeline")


def check(p) -> None:
  """A ConfigError naming the binding for MoE params that cannot work."""
  where = 'moe_feed_forward'
  if p.num_experts < 1:
    raise ConfigError(f'{where}.num_experts is {p.num_experts}', where=f'{where}.num_experts',
                      fix='use at least 1 expert (8 is usual)')
  if not 1 <= p.experts_per_token <= p.num_experts:
    raise ConfigError(f'{where}.experts_per_token is {p.experts_per_token} with '
                      f'{p.num_experts} experts', where=f'{where}.experts_per_token',
                      fix=f'use 1 to {p.num_experts} (2 is usual: Mixtral)')
  if p.router not in ROUTERS:
    raise ConfigError(f'{where}.router is {p.router!r}', where=f'{where}.router',
                      fix=f"use one of {', '.join(map(repr, ROUTERS))}")
  if p.hidden_dim < 0 or p.shared_dim < 0:  # (hidden_dim 0: the LM's ffn_dim)
    raise ConfigError(f'{where}.expert_dim is {p.hidden_dim}, shared_dim {p.shared_dim}',
                      where=f'{where}.expert_dim', fix='use a positive expert width (0: ffn_dim)')
  if p.aux_loss_coef < 0 or p.z_loss_coef < 0:
    raise ConfigError(f'{where}: a negative loss coefficient', where=f'{where}.aux_loss_coef',
                      fix='use coefficients >= 0 (0.01 and 0.001 are usual)')
