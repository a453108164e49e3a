"""meshgin's library: DTensor model parallelism with no gin and no flags.

    from layout_core import LayoutRules, LayoutScope, MeshSpec, build_mesh
    mesh = build_mesh(MeshSpec(shape={'data': 2, 'model': 4}))
    with LayoutScope(mesh=mesh, rules=LayoutRules([(r'.*/ffn/w_in', ('unsharded', 'model'))])):
      lm = transformer_lm_params(num_layers=2).Instantiate()

Subpackages, each owning one part:

  layout/      mesh, layout rules, the layout scope, variables, multi-client cluster
  model/       the Params layer framework, layers, LM recipes, Keras 3 adapter
  tasks/       the Task interface, TFRecord files, the LM tasks
  train/       the training loop, step engines, memory estimate, summaries,
               profiling, preemption
  optim/       the optimizers (Adam, Adafactor), their schedule and state sharding
  pipeline/    pipeline planning and engines (GPipe on sub-meshes, SPMD stage axis)
  run/         putting a run together: the config-time plan and the engine factory
               (above train/ and pipeline/: imports run one way)
  checkpoint/  sharded checkpoints (atomic, sliced per device) and resume
  compat/      the seed-compatibility APIs: Keras' LayoutMap, the TPU
               ReplicatedVariable

plus the foundations: params (Params trees), errors (ConfigError), fields
(type and range checks), lazy (TensorFlow imported on first use), durable
(files written whole or not at all). gin is
attached in `plugins/`; flags live in `launch/`.
"""

from layout_core.errors import ConfigError
from layout_core.model.lm import transformer_lm_params
from layout_core.layout.scope import LayoutScope, plan_layouts
from layout_core.layout.mesh import MeshSpec, build_mesh
from layout_core.params import Params
from layout_core.layout.rules import LayoutRules

__all__ = ['ConfigError', 'LayoutRules', 'LayoutScope', 'MeshSpec', 'Params',
           'build_mesh', 'plan_layouts', 'transformer_lm_params']
