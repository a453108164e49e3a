"""Putting a run together: the plan at config time, the engine and trainer at run time.

    from layout_core.run import make_trainer
    trainer = make_trainer(model=lm, mesh=mesh, rules=rules, task=task,
                           optimizer=OptimizerConfig(), config=TrainConfig(),
                           pipeline=PipelineConfig(num_stages=2))   # or None
    trainer.train()

This package sits above `layout_core.train` (the loop, the whole-mesh engine)
and `layout_core.pipeline` (the pipeline engines, built on the loop's
pieces): it is the one place that imports both, so imports run one way
(`tests/test_imports.py` checks it).

  planning.py  `plan_model`, `plan_pipeline_run`, the model/task checks (no TensorFlow)
  factory.py   `make_engine`, `make_trainer`: the engine the plan asks for
"""

from layout_core.run.factory import make_engine, make_trainer
from layout_core.run.planning import check_segments_supported, plan_model, plan_pipeline_run

__all__ = ['check_segments_supported', 'make_engine', 'make_trainer', 'plan_model',
           'plan_pipeline_run']
