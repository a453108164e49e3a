"""Pipeline parallelism: partitioning, placement, one schedule, two engines.

    from layout_core import pipeline
    config = pipeline.PipelineConfig(num_stages=2, num_micro_batches=8, engine='spmd')
    trainer = make_trainer(model=lm, mesh=mesh, ..., pipeline=config)   # layout_core.run

What a training step runs (`pipeline.engine`):

* 'spmd' (stacks of identical cells, stages overlap on DTensor): the
  embedding runs on the whole mesh; the cells, stacked `[S, R*c, ...]` on the
  stage axis of the same mesh, run as ONE program in `schedule.clock_order`:

      for clock t in 0 .. R*M + S - 2:
        slot 0 <- micro-batch t | stage S-1's output of item t - M | bubble
        every stage s runs its cell chunk on its slot at once (one op over
          the stacked dim); bubble slots compute on zeros and are dropped
        stage S-1's result -> output (last repeat) or back to slot 0 later
        buffer shifts one stage along the axis (shift-matrix einsum)
      final norm + softmax + loss per micro-batch on the whole mesh

  and the tape's reverse gives the backward, in the same compiled function;
  the optimizer's update is a second function on the same mesh.
* 'submesh' (any layers): leaves cut by FLOPs into stages, each on a sub-mesh;
  forward in clock order keeping stage inputs, backward in the reverse clock
  order re-computing each stage (`submesh.GPipe`); two functions per step.

Modules: `config` (PipelineConfig) and `plan` (the checks and plan of a
run), `partitioning` (cost-balanced cuts) and `schedule` (clock order and
bubble), all TensorFlow-free; `stages` (Stage, StageRunner, the staged-model
builder), `placement` (devices, sub-meshes, staged variable creation),
`submesh` (the forward Pipeline and GPipe), `spmd` (StackedCells,
SpmdPipeline), `engines` (the two step engines). Names below are importable from the
package; modules that need TensorFlow load on first use, so importing this
package for its config imports no TensorFlow.
"""

from __future__ import annotations

import importlib

from layout_core.pipeline.config import ENGINES, PipelineConfig
from layout_core.pipeline.partitioning import (PartitionPlan, StagePlan, balanced_counts,
                                            layer_costs, layer_stages, lingvo_counts,
                                            partition, stage_of)
from layout_core.pipeline.schedule import Item, bubble_fraction, clock_order

_LAZY = {
    'Stage': 'stages', 'StageRunner': 'stages', 'run_layers': 'stages',
    'stage_params': 'stages', 'stage_runners': 'stages', 'StagedModel': 'stages',
    'build_staged_model': 'stages',
    'DevicePlacement': 'placement', 'SubMeshPlacement': 'placement',
    'StagedLayoutScope': 'placement',
    'Pipeline': 'submesh', 'GPipe': 'submesh',
    'StackedCells': 'spmd', 'SpmdPipeline': 'spmd',
    'PipelinePlan': 'plan', 'plan_pipeline': 'plan', 'plan_layout_records': 'plan',
    'check_pipelinable': 'plan',
    'GPipeEngine': 'engines', 'SpmdProgram': 'engines', 'spmd_engine': 'engines',
}


def __getattr__(name: str):
  if name in _LAZY:
    module = importlib.import_module(f'layout_core.pipeline.{_LAZY[name]}')
    return getattr(module, name)
  raise AttributeError(f"module 'layout_core.pipeline' has no attribute {name!r}")


__all__ = ['ENGINES', 'PipelineConfig', 'PartitionPlan', 'StagePlan', 'balanced_counts',
           'layer_costs', 'layer_stages', 'lingvo_counts', 'partition', 'stage_of', 'Item',
           'bubble_fraction', 'clock_order', *_LAZY]
