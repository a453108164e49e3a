"""A model built on a mesh, in the one shape every step engine takes.

    built = build_params_model(lm_params, mesh=mesh, rules=rules, seed=0)
    logits = built.call((tokens,), training=True)
    built.variables['lm/emb/table'], built.records[0].spec

A Params tree is instantiated in a `LayoutScope` (every variable created
directly sharded); a Keras 3 model is built by `layout_core.model.keras.build`
into the same `BuiltModel`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

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


def build_params_model(params: Params, *, mesh, rules: LayoutRules | None,
                       seed: int) -> BuiltModel:
  """Instantiates `params` with every variable laid out on `mesh` by `rules`."""
  params = params.Copy().Freeze()
  with LayoutScope(mesh=mesh, rules=rules, seed=seed) as scope:
    module = params.Instantiate()
  return BuiltModel(module=module, call=lambda inputs, training: module(*inputs),
                    variables=scope.variables, records=scope.records,
                    checkpoint_root=module, description=params.ToText())
