"""meshgin's library: DTensor model parallelism with no gin and no flags.

    from layout_core import LayoutRules, LayoutScope, MeshSpec, build_mesh
    mesh = build_mesh(MeshSpec(shape={'data': 2, 'model': 4}))
    with LayoutScope(mesh=mesh, rules=LayoutRules([(r'.*/ffn/w_in', ('unsharded', 'model'))])):
      lm = transformer_lm_params(num_layers=2).Instantiate()

One concept per module: params, mesh, rules, layout_scope, variables, layers,
tasks (the Task interface, TFRecord files), data (the LM tasks), optimizer, trainer,
checkpoint, shard_io, cluster, preemption, pipeline (a package: planning, engines,
trainers), profiling, replicated, keras_models (Keras 3 models laid out by rules),
keras_compat (LayoutMap), summaries. gin is attached in `plugins/`; flags live in
`launch/`.
"""

from layout_core.errors import ConfigError
from layout_core.layers import transformer_lm_params
from layout_core.layout_scope import LayoutScope, plan_layouts
from layout_core.mesh import MeshSpec, build_mesh
from layout_core.params import Params
from layout_core.rules import LayoutRules

__all__ = ['ConfigError', 'LayoutRules', 'LayoutScope', 'MeshSpec', 'Params',
           'build_mesh', 'plan_layouts', 'transformer_lm_params']
