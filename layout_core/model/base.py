"""The Params layer framework: layers that declare their variables and costs.

Every layer is a `tf.Module` built by `p.Instantiate(parent_path=...)`. A layer
class answers three questions from its params alone, without running:

  * `declare_variables(p)`: its own variables (name, shape, initializer);
  * `child_params(p)`: its sub-layers, in order;
  * `fprop_meta(p, *input_shapes)`: output shapes and forward FLOPs.

so the whole model's variables (`variable_specs`) and cost per layer
(`fprop_meta`) are known before anything is allocated: `launch.inspect` plans a
100B-parameter model in seconds and the pipeline balances stages by FLOPs.

    p = Sequential.Params().Set(name='mlp', sub=[FeedForward.Params()])
    Sequential.fprop_meta(p, (8, 64))          # LayerMeta(out_shapes=((8, 64),), ...)
    mlp = p.Instantiate()                      # variables at 'mlp/ffn/w_in', ...

FLOPs count a multiply-add as 2 (`matmul_flops`) plus one per output element of
each elementwise op (`flops` includes both). The library's layers are in
`layout_core.model.layers`, the LM recipes in `layout_core.model.lm`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Mapping

from layout_core.lazy import Module, tf
from layout_core.errors import ConfigError
from layout_core.params import Params, once_per_frozen
from layout_core.layout import fsdp
from layout_core.layout.variables import Initializer, VariableSpec, create_variable
from layout_core.model import frozen, lora
from layout_core.model.remat import floating, rematerialized
from layout_core.model.weights import LayerWeights, as_used, cast

Shape = tuple[int, ...]

@dataclasses.dataclass(frozen=True)
class LayerMeta:
  """What `BaseLayer.fprop_meta` answers: a layer's output shapes and the
  FLOPs of its forward pass, for given input shapes.

      LayerMeta(out_shapes=((8, 32),), flops=2 * 8 * 16 * 32 + 8 * 32,
                matmul_flops=2 * 8 * 16 * 32)   # x [8, 16] @ w [16, 32] + b

  Attributes:
    out_shapes: The shape of each output, in order (one tuple per output).
    flops: All forward FLOPs: `matmul_flops` plus one per output element of
      each elementwise op (bias, activation, residual add).
    matmul_flops: 2 x the multiply-adds of the dense contractions (matmuls,
      einsums with weights).
  """
  out_shapes: tuple[Shape, ...]
  flops: int         # all forward FLOPs, matmul + elementwise
  matmul_flops: int  # 2 * multiply-adds of the dense contractions


@dataclasses.dataclass(frozen=True)
class Declared:
  """A variable a layer owns, as `BaseLayer.declare_variables` lists it.

      Declared('w', (p.input_dim, p.output_dim), Normal(p.init_stddev))
      Declared('b', (p.output_dim,), Zeros())

  Attributes:
    name: The variable's attribute name on the built layer (`self.w`) and the
      last component of its path (`clf/gated/w`); an identifier.
    shape: Its shape, from the params.
    initializer: A `layout_core.layout.variables.Initializer` (`Normal`,
      `Constant`, `Zeros()`, `Ones()`): initial values do not depend on the
      layout.
    unshardable: Dimensions DTensor cannot run the variable sharded on,
      {dimension: why, and what works instead}; a layout rule that shards one
      of them is a configuration error with that text.
  """
  name: str
  shape: Shape
  initializer: Initializer
  unshardable: Mapping[int, str] = dataclasses.field(default_factory=dict)
  inputs: int = 0
  """How many leading dims the layer contracts with its input (`w.dense`,
  `w.project`): 1 for x @ w [d, f], 2 for attention's output [h, k, d]; 0:
  not such a weight. Only these can take LoRA adapters
  (`layout_core.model.lora`)."""
  lead: int = 0
  """Leading dims before those that the weight shares with its input and
  output, uncontracted: a routed layer's expert dim ([E, d, f],
  `layout_core.model.moe`). Its adapters and int8 scales are per index of
  them."""
  exact: bool = False
  """Stays float32 in a frozen base stored narrow (`train.frozen_dtype`):
  a router, whose top-k choice a rounding can flip."""


def num_elements(shape: Shape) -> int:
  return math.prod(shape)


class BaseLayer(Module):
  """The base of Params layers: a layer declared from its params alone.

  A subclass answers, from its params and without building anything:

    * `Params()`: its settings (`super().Params()`, then `p.Define(...)`);
    * `declare_variables(p)`: its own variables (`Declared`);
    * `child_params(p)`: its sub-layers' params, by attribute name;
    * `fprop_meta(p, *input_shapes)`: its output shapes and forward FLOPs;

  and computes in `fprop(self, *inputs)`, reading its variables with
  `self.weight(name)`, or, to be stackable as an SPMD pipeline cell, in a
  classmethod `apply(cls, p, w, *inputs)` (see `apply`).

  `p.Instantiate(parent_path=...)` builds it. The class is plain Python until
  then (`layout_core.lazy.Module`); an instance is a `tf.Module`. Building
  creates each declared variable as the attribute `self.<name>` at the path
  `<parent_path>/<p.name>/<name>`, through the one door that lets a layout
  scope shard it as it is born
  (`layout_core.layout.variables.create_variable`), then builds each child
  as `self.<child name>`. A call casts floating inputs to `compute_dtype`
  and runs `fprop` (recomputed in the backward pass when `p.remat`).

  A whole layer, tested: `tests/fixtures/my_project/layers.py` (shown on
  docs/own-model.md and the API reference).
  """

  @classmethod
  def Params(cls) -> Params:
    """The layer's default params. A subclass extends its parent's:

        p = super().Params()
        p.name = 'gated'                     # the default name
        p.Define('output_dim', 32, 'Output width.')
        return p

    Every layer has `cls` (the class `Instantiate` builds), `name` (its
    variable path component, an identifier), `dtype` (its variables'),
    `fprop_dtype` (its math's; None: `dtype`) and `remat`.
    """
    p = Params()
    p.Define('cls', cls, 'Layer class that Instantiate() builds.')
    p.Define('name', cls.__name__.lower(), 'Layer name: its variable path component.')
    p.Define('dtype', 'float32', 'Variable dtype.')
    p.Define('fprop_dtype', None, 'Dtype of the forward and backward math; None: dtype. '
             'Weights are cast at use; sub-layers inherit it.')
    p.Define('remat', False, "Recompute this layer's activations in the backward pass "
             'instead of keeping them (train.remat sets it).')
    p.Define('tuning', None, 'A layout_core.model.lora.Tuning: which weights train and '
             'which get LoRA adapters (lora.*, train.trainable set it); sub-layers inherit it.')
    return p

  def __init__(self, params: Params, *, parent_path: str = ''):
    """Builds the layer: its variables, then its children (see the class doc).

    Args:
      params: The layer's params; a frozen copy becomes `self.params`.
      parent_path: The path of the layer above (`''` for the root): the
        layer's own path, `self.path`, is `<parent_path>/<params.name>`.

    Raises:
      ConfigError: `params.name` is not an identifier.
    """
    if not params.name or not params.name.isidentifier():
      raise ConfigError(f'layer name {params.name!r} must be an identifier',
                        where=f"{parent_path or '<root>'} ({type(self).__name__})")
    super().__init__(name=params.name)
    self.params = params.Copy().Freeze()
    self.path = f'{parent_path}/{params.name}' if parent_path else params.name
    specs = self.own_variable_specs(self.params, self.path)
    self.variable_names = tuple(spec.path.rsplit('/', 1)[1] for spec in specs)
    for name, spec in zip(self.variable_names, specs):
      setattr(self, name, create_variable(spec))
    frozen.pair_scales({name: getattr(self, name) for name in self.variable_names})
    children = self.child_params(self.params)
    self.child_names = tuple(children)
    for name, child in children.items():
      setattr(self, name, _inherited(child, params).Instantiate(parent_path=self.path))
    for child in self.children():
      child.link_siblings(self)

  # -- declarations (classmethods: usable without building) ---------------------
  @classmethod
  def declare_variables(cls, p: Params) -> list[Declared]:
    """The layer's own variables (not its children's), from its params.

        return [Declared('w', (p.input_dim, p.output_dim), Normal(p.init_stddev)),
                Declared('b', (p.output_dim,), Zeros())]

    Default: none. `launch.inspect`, the layout plan and the checkpoint's
    variable list read it without building the layer.
    """
    return []

  @classmethod
  def child_params(cls, p: Params) -> dict[str, Params]:
    """The layer's sub-layers' params, {attribute name: params}, in order.

    A composite layer builds its children from its own settings, e.g.
    `{'ffn': FeedForward.Params().Set(input_dim=p.model_dim)}`; each is built
    as `self.<name>` under this layer's path, and inherits its
    `fprop_dtype` when it sets none. Default: none.
    """
    return {}

  @classmethod
  def own_variable_specs(cls, p: Params, path: str) -> list[VariableSpec]:
    """The layer's own variables at `path`; under `p.tuning`, frozen where
    it says (stored in its `frozen_dtype`) and each LoRA target followed by
    its two adapters."""
    tuning, specs = p.tuning, []
    for d in cls.declare_variables(p):
      spec = VariableSpec(
          path=f'{path}/{d.name}', shape=tuple(d.shape), initializer=d.initializer,
          dtype=p.dtype, unshardable=dict(d.unshardable),
          trainable=tuning is None or tuning.trains(f'{path}/{d.name}'))
      specs += frozen.stored_specs(spec, inputs=d.inputs, lead=d.lead, frozen_dtype=(
          tuning.frozen_dtype if tuning and not d.exact else 'float32'))
      if tuning is not None and tuning.lora and d.inputs and tuning.lora.adapts(spec.path):
        specs += lora.adapter_specs(spec, inputs=d.inputs, lead=d.lead, lora=tuning.lora)
    return specs

  @classmethod
  def variable_specs(cls, p: Params, parent_path: str = '') -> list[VariableSpec]:
    """Every variable this layer and its children would create, in order."""
    path = f'{parent_path}/{p.name}' if parent_path else p.name
    specs = cls.own_variable_specs(p, path)
    for child in cls.child_params(p).values():
      child = _inherited(child, p, dtype=False)
      specs += child.cls.variable_specs(child, path)
    return specs

  @classmethod
  def fprop_meta(cls, p: Params, *input_shapes: Shape) -> LayerMeta:
    """Output shapes and forward FLOPs for inputs of `input_shapes`, from the
    params alone.

    Every run plans with it before anything is built: the cost report of
    `launch.inspect`, the activation memory estimate, the FLOP-rate scalars
    (`train/model_flops_per_sec`, `train/mfu`) and the pipeline's stage
    balancing. A subclass must define it.

    Args:
      p: The layer's params.
      *input_shapes: One shape per input `fprop` takes, e.g. `(batch, dim)`.

    Returns:
      The output shapes and FLOPs (`LayerMeta`).
    """
    raise NotImplementedError(f'{cls.__name__}.fprop_meta')

  # -- running ------------------------------------------------------------------
  @property
  def compute_dtype(self) -> str:
    """The dtype this layer computes in (`fprop_dtype`, else the variables')."""
    return self.params.fprop_dtype or self.params.dtype

  def weight(self, name: str) -> tf.Tensor:
    """Variable `name` as the math uses it: cast to the compute dtype, gathered
    when FSDP stores it split (`fsdp.at_use`), times its scale when stored
    in int8 (`layout_core.model.frozen`). A user layer's `fprop` reads its
    weights through this (or `LayerWeights`): a variable read directly is
    still right, but FSDP then leaves its communication to DTensor."""
    return as_used(getattr(self, name), self.compute_dtype)

  def link_siblings(self, parent: Module) -> None:
    """Once `parent` built every child: take a sibling's variable (`Softmax.tied_to`)."""

  def children(self) -> list['BaseLayer']:
    """The built sub-layers, in `child_params` order."""
    return [getattr(self, n) for n in self.child_names]

  def split_weights(self):
    """(variable, compute dtype) of every weight of this layer and its
    sub-layers that FSDP stores split."""
    for name in self.variable_names:
      variable = getattr(self, name)
      if fsdp.use_layout(variable) is not None:
        yield variable, self.compute_dtype
    for child in self.children():
      yield from child.split_weights()

  apply = None
  """None, or the layer's math as a classmethod `apply(cls, p, w, *inputs)`.

  Written once over `Weights` `w` (`w(name)`, `w.dense`, `w.project`,
  `w.vector`, `w.child`, `w.random()`, `w.context`), it serves both the
  layer's own `fprop` (`w` a `LayerWeights` over its variables) and the SPMD
  pipeline's stacked cells (every weight with a leading slot dimension), so
  a pipeline can stack the layer (`stackable`).

      @classmethod
      def apply(cls, p, w, x):
        h = tf.nn.relu(w.dense(x, 'w_in') + w.vector('b_in', x))
        return w.dense(h, 'w_out') + w.vector('b_out', h)
  """

  @classmethod
  def stackable(cls, p: Params) -> bool:
    """Whether `apply` covers this layer and every sub-layer."""
    return cls.apply is not None and all(
        c.cls.stackable(c) for c in cls.child_params(p).values())

  def fprop(self, *inputs):
    """The layer's forward pass on inputs already in `compute_dtype`.

    Override it, reading variables with `self.weight(name)` and running
    children as `self.<child name>(x)`; or define `apply` instead, which this
    default runs on the layer's own variables. Return one tensor, or a tuple
    for several outputs (a `Sequential` passes a tuple on as the next
    layer's inputs).
    """
    if self.apply is None:
      raise NotImplementedError(f'{type(self).__name__}.fprop')
    return self.apply(self.params, LayerWeights(self, inputs=inputs), *inputs)

  def __call__(self, *inputs):
    inputs = tuple(cast(x, self.compute_dtype) if floating(x) else x for x in inputs)
    if self.params.remat:
      return rematerialized(self.fprop, *inputs)
    return self.fprop(*inputs)


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
    if not p.IsFrozen():
      return cls._children(p)
    return dict(once_per_frozen(_CHILDREN, p, id(p), lambda: {  # a plan's: frozen too
        name: child.Freeze() for name, child in cls._children(p).items()}))

  @classmethod
  def _children(cls, p):
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


def _inherited(child: Params, parent: Params, *, dtype: bool = True) -> Params:
  """`child` taking its parent's fprop dtype (`dtype`) and tuning where it sets none."""
  inherit = {}
  if dtype and child.fprop_dtype is None and parent.fprop_dtype is not None:
    inherit['fprop_dtype'] = parent.fprop_dtype
  if child.tuning is None and parent.tuning is not None:
    inherit['tuning'] = parent.tuning
  return child.Copy().Set(**inherit) if inherit else child


def as_float32(x):
  """Floating outputs as float32: the task's loss and metrics always see
  float32 logits, whatever the compute dtype (a no-op for float32 runs)."""
  if isinstance(x, (tuple, list)):
    return type(x)(as_float32(v) for v in x)
  return cast(x, tf.float32) if floating(x) else x


def compute_params(p: Params, *, dtype: str = 'float32', remat: str = 'none') -> Params:
  """`p` set up to compute in `dtype` under the `remat` policy
  (`layout_core.train.config.REMAT_POLICIES`): 'block' marks every composite
  layer (one with sub-layers, e.g. a TransformerBlock) to recompute, 'full'
  every layer below the Sequentials. Defaults return `p` unchanged."""
  if dtype == p.dtype and remat == 'none':
    return p
  p = p.Copy()

  def walk(node: Params) -> None:
    node.fprop_dtype = dtype
    if issubclass(node.cls, Sequential):
      for sub in node.sub:
        walk(sub)
    elif remat == 'full' or (remat == 'block' and node.cls.child_params(node)):
      node.remat = True
  walk(p)
  return p.Freeze()


def num_parameters(p: Params) -> int:
  """Its weights' elements (an int8 weight's scales are storage, not parameters)."""
  return sum(s.num_elements for s in p.cls.variable_specs(p) if not frozen.is_scale(s.path))


def flatten_layers(p: Params) -> list[Params]:
  """Leaf layers of nested/repeated Sequentials, in execution order.

  Leaves keep the names they would have as children (block_000, ...), so a
  stage built from them creates variables at recognisable paths.
  """
  return [leaf for _, leaf in leaf_layers(p)]


def leaf_layers(p: Params, parent_path: str = '') -> list[tuple[str, Params]]:
  """(path, params) of every leaf layer, in execution order: the paths the
  leaves get when `p` is instantiated (`lm/emb`, `lm/stack/block_000`, ...).
  A frozen tree's leaves (a run's plan) are frozen too, and found once."""
  if parent_path or not p.IsFrozen():
    return _leaf_layers(p, parent_path)
  return list(once_per_frozen(_LEAVES, p, id(p), lambda: [
      (path, leaf.Freeze()) for path, leaf in _leaf_layers(p, '')]))


def frozen_meta(p: Params, shapes: tuple) -> LayerMeta:
  """`p.cls.fprop_meta(p, *shapes)` once per frozen `p` and shapes (for the suggester)."""
  return once_per_frozen(_METAS, p, (id(p), shapes), lambda: p.cls.fprop_meta(p, *shapes))


_METAS, _LEAVES, _CHILDREN = {}, {}, {}  # once_per_frozen's caches


def _leaf_layers(p: Params, parent_path: str) -> list[tuple[str, Params]]:
  path = f'{parent_path}/{p.name}' if parent_path else p.name
  if p.cls is not Sequential:
    return [(path, p.Copy())]
  leaves = []
  for child in Sequential.child_params(p).values():
    leaves += _leaf_layers(child, path)
  return leaves


def leaf_modules(layer: BaseLayer) -> list[BaseLayer]:
  """The built leaf layers of `layer`, in execution order (cf. `leaf_layers`)."""
  if layer.params.cls is not Sequential:  # as in leaf_layers: subclasses are leaves
    return [layer]
  return [leaf for child in layer.children() for leaf in leaf_modules(child)]
