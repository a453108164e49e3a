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
from layout_core.params import Params
from layout_core.layout import fsdp
from layout_core.layout.variables import Initializer, VariableSpec, create_variable
from layout_core.model.weights import LayerWeights, cast
from layout_core.step_context import current, entered

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


def num_elements(shape: Shape) -> int:
  return math.prod(shape)


class BaseLayer(Module):
  """Params-built module (a tf.Module once built, see `layout_core.lazy`);
  subclasses declare variables, children and costs."""

  @classmethod
  def Params(cls) -> Params:
    p = Params()
    p.Define('cls', cls, 'Layer class that Instantiate() builds.')
    p.Define('name', cls.__name__.lower(), 'Layer name: its variable path component.')
    p.Define('dtype', 'float32', 'Variable dtype.')
    p.Define('fprop_dtype', None, 'Dtype of the forward and backward math; None: dtype. '
             'Weights are cast at use; sub-layers inherit it.')
    p.Define('remat', False, "Recompute this layer's activations in the backward pass "
             'instead of keeping them (train.remat sets it).')
    return p

  def __init__(self, params: Params, *, parent_path: str = ''):
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
    children = self.child_params(self.params)
    self.child_names = tuple(children)
    for name, child in children.items():
      if child.fprop_dtype is None and params.fprop_dtype is not None:
        child = child.Copy().Set(fprop_dtype=params.fprop_dtype)
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
  @property
  def compute_dtype(self) -> str:
    """The dtype this layer computes in (`fprop_dtype`, else the variables')."""
    return self.params.fprop_dtype or self.params.dtype

  def weight(self, name: str) -> tf.Tensor:
    """Variable `name` as the math uses it: cast to the compute dtype, and
    gathered when FSDP stores it split (`layout_core.layout.fsdp.at_use`). A
    user layer's own `fprop` reads its weights through this (or
    `LayerWeights`): a variable read directly is still right, but FSDP then
    leaves its communication to DTensor."""
    return fsdp.at_use(getattr(self, name), self.compute_dtype)

  def children(self) -> list['BaseLayer']:
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

  # A layer may write its math once as a classmethod `apply(cls, p, w, *inputs)`
  # over `Weights` w: its fprop is then `apply` on its own variables, and the
  # SPMD pipeline runs the same `apply` on stacked cells (`stackable`).
  apply = None

  @classmethod
  def stackable(cls, p: Params) -> bool:
    """Whether `apply` covers this layer and every sub-layer."""
    return cls.apply is not None and all(
        c.cls.stackable(c) for c in cls.child_params(p).values())

  def fprop(self, *inputs):
    if self.apply is None:
      raise NotImplementedError(f'{type(self).__name__}.fprop')
    return self.apply(self.params, LayerWeights(self, inputs=inputs), *inputs)

  def __call__(self, *inputs):
    inputs = tuple(cast(x, self.compute_dtype) if _floating(x) else x for x in inputs)
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


def _floating(x) -> bool:
  return bool(getattr(getattr(x, 'dtype', None), 'is_floating', False))


def as_float32(x):
  """Floating outputs as float32: the task's loss and metrics always see
  float32 logits, whatever the compute dtype (a no-op for float32 runs)."""
  if isinstance(x, (tuple, list)):
    return type(x)(as_float32(v) for v in x)
  return cast(x, tf.float32) if _floating(x) else x


def rematerialized(fn, *inputs):
  """fn(*inputs), its activations recomputed in the backward pass instead of
  kept. The recomputation runs in the forward pass's step context
  (`layout_core.step_context`), so it computes the same function: the same
  dropout masks, the same packed documents. Gradients reach `inputs`
  and the variables `fn` reads; a tensor `fn` only captures gets none, so
  pass such tensors as inputs. Inputs with no floating tensor (token ids)
  have no activations worth recomputing: fn runs as is.

  Not `tf.recompute_grad`: its recomputation depends only on the kept
  inputs, so inside a step function the executor ran it as early as the
  forward pass, or DTensor's compiler merged it with the forward (a control
  dependency on the incoming gradient, through `tf.identity`, was folded
  away), and nothing was saved: a width-256, 8-block LM's gradients function
  peaked at 2.14 GiB with it, 1.93 without remat. Here the recomputation's
  first input is tied to the incoming gradient by adding 0 x its sum (exact
  for finite gradients): 1.68 GiB."""
  if not any(_floating(x) for x in inputs):
    return fn(*inputs)
  # The backward pass runs outside the forward's blocks: the recomputation
  # enters the forward's whole step context again (dropout masks, packed
  # segments, residual pin, batch split), marked as rematerialized.
  context = current().replace(remat=True)
  tied = next(i for i, x in enumerate(inputs) if _floating(x))

  def run(*args):
    with entered(context):
      return fn(*args)

  @tf.custom_gradient
  def recomputed(*args):
    def gradient(*output_grads, variables=()):
      zero = tf.add_n([tf.reduce_sum(tf.cast(g, tf.float32)) for g in output_grads]) * 0.0
      again = list(args)
      again[tied] = args[tied] + tf.cast(zero, args[tied].dtype)
      with tf.GradientTape(watch_accessed_variables=False) as tape:
        tape.watch(again)
        tape.watch(variables)
        outputs = run(*again)
      grads = tape.gradient(outputs, again + list(variables),
                            output_gradients=list(output_grads))
      return grads[:len(args)], grads[len(args):]
    return run(*args), gradient
  return recomputed(*inputs)


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
