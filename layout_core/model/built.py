"""A model built on a mesh, in the one shape every step engine takes.

    built = build_params_model(lm_params, mesh=mesh, rules=rules, seed=0)
    logits = built.call((tokens,), training=True)
    built.variables['lm/emb/table'], built.records[0].spec

A Params tree is instantiated in a `LayoutScope` (every variable created
directly sharded); a Keras 3 model is built by `layout_core.model.keras.build`
into the same `BuiltModel`. Engines compile the functions that run it with
`StepFunction`:

    gradients = StepFunction(engine_gradients_fn)   # a tf.function, AutoGraph if needed
    function, concrete = traced_function(serve, input_signature=[...])  # the same, traced now
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

from layout_core.lazy import tf
from layout_core.layout.scope import LayoutRecord, LayoutScope
from layout_core.layout.rules import LayoutRules
from layout_core.params import Params


@dataclasses.dataclass
class BuiltModel:
  module: Any                              # the model (tf.Module or keras.Model)
  call: Callable[[Sequence[Any], bool], Any]  # (model inputs, training) -> outputs
  variables: dict[str, Any]                # path -> variable, in creation order
  records: list[LayoutRecord]              # every variable's layout
  checkpoint_root: Any                     # what a checkpoint holds as 'model'
  description: str                         # params.txt: the Params tree, or the model's
  # path -> leading dims stacking several layers' copies (SPMD cells: 2)
  lead_dims: dict[str, int] = dataclasses.field(default_factory=dict)
  fsdp_axis: str | None = None             # parameters stored split over it (train.fsdp)


def build_params_model(params: Params, *, mesh, rules: LayoutRules | None,
                       seed: int, fsdp_axis: str | None = None,
                       zero_init: bool = False) -> BuiltModel:
  """Instantiates `params` with every variable laid out on `mesh` by `rules`
  (and stored split over `fsdp_axis`, `layout_core.layout.fsdp`); with
  `zero_init` every variable starts as zeros (`LayoutScope`)."""
  params = params.Copy().Freeze()
  with LayoutScope(mesh=mesh, rules=rules, seed=seed, fsdp_axis=fsdp_axis,
                   zero_init=zero_init) as scope:
    module = params.Instantiate()
  return BuiltModel(module=module, call=lambda inputs, training: module(*inputs),
                    variables=scope.variables, records=scope.records,
                    checkpoint_root=module, description=params.ToText(), fsdp_axis=fsdp_axis)


class StepFunction:
  """`tf.function(fn)`, traced without AutoGraph unless the traced code needs it.

  AutoGraph rewrites every Python function a step calls so that Python `if`,
  `for` and `while` on tensors become graph control flow; the library's layers,
  tasks and optimizers have none, and converting them was the largest part of
  tracing (the quickstart's three step functions: ~3.5 of ~4.5 CPU-s,
  bench/startup.py). A model or task that does branch on a tensor (a user's
  layer, a Keras model) makes the plain trace raise
  `OperatorNotAllowedInGraphError`; it is then traced again with AutoGraph,
  exactly as `tf.function(fn)` would have, and keeps that from then on."""

  def __init__(self, fn):
    self._fn = fn
    self._function = tf.function(fn, autograph=False)
    self.autograph = False

  def __call__(self, *args):
    if self.autograph:
      return self._function(*args)
    try:
      return self._function(*args)
    except tf.errors.OperatorNotAllowedInGraphError:  # Python control flow on a tensor
      self._function, self.autograph = tf.function(self._fn), True
      return self._function(*args)


def traced_function(fn, *, input_signature: Sequence[Any]):
  """(`tf.function(fn, input_signature=...)`, its concrete function), traced
  now without AutoGraph unless the traced code needs it (`StepFunction`'s
  rule): what a SavedModel's signature is made of. Converting the library's
  code was most of an export (the quickstart's serving and generate
  signatures: 7.7 CPU-s with AutoGraph, 1.2 without, the same logits;
  bench/export_trace.py)."""
  try:
    function = tf.function(fn, input_signature=input_signature, autograph=False)
    return function, function.get_concrete_function()
  except tf.errors.OperatorNotAllowedInGraphError:  # Python control flow on a tensor
    function = tf.function(fn, input_signature=input_signature)
    return function, function.get_concrete_function()
