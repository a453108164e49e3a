"""Tied input and output embeddings (`transformer_lm.tie_embeddings`).

The reference is the untied model with its own output matrix set to the
embedding table transposed: the same function computed by another code path
(`Softmax.logits` with `w`, not the table). Checked on one device and on a
2x4 Megatron mesh (the table split over its features, moved to the
vocabulary for the logits), through the layers' own forward pass and the
KV-cache decoder; trained, the one-program engine on `data=8` and the SPMD
pipeline on `stage x data x model` train the same function, the checkpoint
holds the table once, its SavedModel computes the checkpoint's logits, and
the sub-mesh engine, which would put the table and the softmax on different
devices, exits 2 naming both.
"""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.experimental import dtensor

from layout_core.checkpoint.shard_io import assign_global
from layout_core.infer.decode import CachedLM
from layout_core.layout.mesh import pack_global_array
from layout_core.layout.rules import UNSHARDED, LayoutRules
from layout_core.layout.variables import to_numpy
from layout_core.model.built import build_params_model
from layout_core.model.lm import transformer_lm_params
from tests.conftest import SPMD_ON_FOUR, read_events, run_module, run_modules
from tests.numerics import assert_close
from tests.test_decode import LOGITS, MEGATRON
from tests.test_export import meshgin_outputs

SHAPE = dict(vocab_size=32, model_dim=32, num_heads=4, ffn_dim=64, num_layers=2, max_len=24)
TIED = transformer_lm_params(**SHAPE, tie_embeddings=True)
UNTIED = transformer_lm_params(**SHAPE)
# Losses of one run against another run of the same function (tests/numerics.py):
# another mesh and engine sum in another order. measured: 0 / 0 / 0 (default / no oneDNN /
# 1 thread, 2026-11-29; 1.1e-07 with the SPMD run on 8 devices). The logits (LOGITS) measured
# 0 under all three.
ORDER = 1e-5


def random_values(params, seed: int = 0) -> dict[str, np.ndarray]:
  rng = np.random.default_rng(seed)
  return {spec.path: ((1 if spec.path.endswith('scale') else 0)
                      + 0.5 * rng.standard_normal(spec.shape)).astype(np.float32)
          for spec in params.cls.variable_specs(params)}


@pytest.fixture(scope='module')
def values():
  tied = random_values(TIED)
  untied = dict(tied, **{'lm/softmax/w': tied['lm/emb/table'].T.copy()})
  return tied, untied


def on_mesh(params, values, mesh, rules):
  built = build_params_model(params, mesh=mesh, rules=rules, seed=0)
  for path, variable in built.variables.items():
    assign_global(variable, values[path])
  return built


def test_the_tied_model_has_one_matrix_for_both():
  paths = [s.path for s in TIED.cls.variable_specs(TIED)]
  assert 'lm/emb/table' in paths and 'lm/softmax/w' not in paths
  untied = sum(int(np.prod(s.shape)) for s in UNTIED.cls.variable_specs(UNTIED))
  tied = sum(int(np.prod(s.shape)) for s in TIED.cls.variable_specs(TIED))
  assert untied - tied == SHAPE['vocab_size'] * SHAPE['model_dim']


@pytest.mark.parametrize('mesh_name', ['mesh_data8', 'mesh_2x4'])
def test_logits_equal_the_untied_model_with_the_table_as_its_matrix(values, mesh_name, request):
  mesh = request.getfixturevalue(mesh_name)
  rules = MEGATRON if mesh_name == 'mesh_2x4' else LayoutRules([])
  tied_values, untied_values = values
  tokens = np.random.default_rng(1).integers(0, 32, [8, 12]).astype(np.int32)
  on_devices = pack_global_array(tokens, dtensor.Layout(['data', UNSHARDED], mesh))
  untied = on_mesh(UNTIED, untied_values, mesh, rules)
  reference = to_numpy(tf.function(untied.module)(on_devices))
  tied = on_mesh(TIED, tied_values, mesh, rules)
  assert len(tied.variables) == len(untied.variables) - 1
  forward = to_numpy(tf.function(tied.module)(on_devices))
  assert_close(forward, reference, rel=LOGITS, what='the tied model\'s logits')
  decoder = CachedLM(TIED, tied.variables, batch_axis='data')
  assert_close(to_numpy(decoder.logits(tokens)), reference, rel=LOGITS, what='decoder logits')
  prompts, lengths = tokens[:, :6], np.full([8], 6, np.int32)
  cached = to_numpy(decoder.generate(prompts, lengths, max_new_tokens=6))
  recomputed = to_numpy(decoder.generate_by_recomputing(prompts, lengths, max_new_tokens=6))
  np.testing.assert_array_equal(cached, recomputed)
  assert np.abs(reference).max() > 1  # a positive control: logits far from all-equal


# -- trained ---------------------------------------------------------------------------------
TRAIN = ['--gin_bindings=transformer_lm.tie_embeddings = True',
         '--gin_bindings=train.num_steps = 4',
         '--gin_bindings=train.log_every = 1', '--gin_bindings=train.eval_every = 0',
         '--gin_bindings=train.batch_size = 16',
         "--gin_bindings=optimizer.decay = 'constant'"]
SPMD = ['--gin_file=configs/experiments/lm_pipeline_spmd.gin',
        SPMD_ON_FOUR,  # a stage's table still split over 'model'
        '--gin_bindings=pipeline.num_micro_batches = 2',
        '--gin_bindings=pipeline.circular_repeats = 1',
        '--gin_bindings=transformer_lm.num_layers = 2']


@pytest.fixture(scope='module')
def trained(tmp_path_factory):
  """{name: model_dir} and the runs: lm_pipeline_spmd.gin tied (Megatron
  rules: the table split over 'model'), the same model on data=2 without a
  pipeline, and lm_pipeline.gin tied (the sub-mesh engine)."""
  root = tmp_path_factory.mktemp('tied')
  dirs = {name: str(root / name) for name in ('plain', 'spmd', 'gpipe')}
  plain = [*SPMD, "--gin_bindings=mesh.shape = {'stage': 1, 'data': 2}",
           '--gin_bindings=pipeline.num_stages = 1',
           '--gin_bindings=pipeline.num_micro_batches = 1',
           '--gin_bindings=layout_rules.rules = []']
  done = run_modules([('launch.train', *plain, *TRAIN, f'--model_dir={dirs["plain"]}'),
                      ('launch.train', *SPMD, *TRAIN, f'--model_dir={dirs["spmd"]}'),
                      ('launch.train', '--gin_file=configs/experiments/lm_pipeline.gin', *TRAIN,
                       f'--model_dir={dirs["gpipe"]}')], timeout=400)
  for run in done[:2]:
    assert run.returncode == 0, run.stderr[-3000:]
  return dirs, done


def test_the_spmd_pipeline_trains_the_one_program_engines_function(trained):
  """The SPMD pipeline's losses are the one-program engine's; the sub-mesh engine exits 2."""
  dirs, done = trained
  losses = {name: np.array([v for _, v in read_events(dirs[name])['scalars']['train/loss']])
            for name in ('plain', 'spmd')}
  assert len(losses['plain']) == 4 and losses['plain'][-1] < losses['plain'][0]
  assert_close(losses['spmd'], losses['plain'], rel=ORDER, what='SPMD pipeline losses')
  keys = [name for name, _ in tf.train.list_variables(f'{dirs["spmd"]}/checkpoints/ckpt-4/ckpt')]
  assert 'model/emb/table/.ATTRIBUTES/VARIABLE_VALUE' in keys  # the table, once
  assert not any('softmax/w' in k for k in keys)
  assert done[2].returncode == 2, done[2].stderr[-3000:]
  assert 'tied embeddings' in done[2].stderr and "pipeline.engine = 'spmd'" in done[2].stderr


def test_the_saved_model_gives_the_checkpoints_logits(trained, mesh_data8, tmp_path):
  """launch.export of the pipelined tied run: TensorFlow's loader alone
  computes what the checkpoint's model computes on data=8."""
  dirs, _ = trained
  export_dir = str(tmp_path / 'export')
  done = run_module('launch.export', f'--model_dir={dirs["spmd"]}', f'--export_dir={export_dir}')
  assert done.returncode == 0, done.stderr[-3000:]
  tokens = np.random.default_rng(0).integers(0, 64, (8, 64)).astype(np.int32)
  serving = tf.saved_model.load(export_dir).signatures['serving_default']
  exported = serving(tokens=tf.constant(tokens))['logits'].numpy()
  reference = meshgin_outputs(f'{dirs["spmd"]}/checkpoints/ckpt-4/ckpt', (tokens,), mesh_data8)
  # test_export.py's bound for an export against meshgin on data=8. measured here: 2.1e-07
  # under each of default / no oneDNN / 1 thread (2026-11-29)
  assert_close(exported, reference, rel=5e-6, what='SavedModel logits')

