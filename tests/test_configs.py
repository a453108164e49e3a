"""Every .gin file under configs/ parses and builds (planned without allocation),
and every sweep file under configs/sweeps/ plans each of its trials.

Partial files are parsed on top of what they need: runs/ with the tiny model,
models/ and layouts/ on top of the run defaults; experiments stand alone.
"""

import glob
import os

import gin
import pytest

from plugins import gin_setup, plan as plan_lib
from plugins.sweep import spec as sweep_spec
from tests.conftest import REPO_ROOT

BASE_RUN = 'configs/runs/train.gin'
BASE_MODEL = 'configs/models/lm_tiny.gin'


def all_configs():
  files = glob.glob(os.path.join(REPO_ROOT, 'configs', '**', '*.gin'), recursive=True)
  return sorted(os.path.relpath(f, REPO_ROOT) for f in files)


# Each layout file with a model of the family it is for, and its rules strict:
# every rule must decide some variable (transformer_lm's options per family).
LAYOUT_MODELS = {
    'megatron.gin': ('configs/models/lm_tiny.gin', []),
    'megatron_gpt2.gin': ('configs/models/lm_tiny.gin', [
        'transformer_lm.qkv_bias = True', 'transformer_lm.attention_out_bias = True',
        "transformer_lm.activation = 'gelu_tanh'", 'transformer_lm.output_bias = False']),
    'megatron_llama.gin': ('configs/models/llama_tiny.gin', []),
    'megatron_qwen2.gin': ('configs/models/llama_tiny.gin', ['transformer_lm.qkv_bias = True']),
    'moe_expert.gin': ('configs/models/moe_tiny.gin', []),
    'moe_expert_megatron.gin': ('configs/models/moe_tiny.gin', []),
    'moe_expert_fsdp.gin': ('configs/models/moe_tiny.gin', []),
}
# The mesh each layout file is parsed on (its rules' axes); default data=2 x model=4.
LAYOUT_MESHES = {
    'moe_expert.gin': "{'expert': 4, 'data': 2}",
    'moe_expert_megatron.gin': "{'expert': 2, 'data': 2, 'model': 2}",
    'moe_expert_fsdp.gin': "{'expert': 4, 'data': 2}",
}


def stack_for(path):
  kind = path.split(os.sep)[1]
  if kind == 'runs':
    return [path, BASE_MODEL]
  if kind == 'models':
    return [BASE_RUN, path]
  if kind == 'layouts':
    return [BASE_RUN, LAYOUT_MODELS[os.path.basename(path)][0], path]
  return [path]


def test_there_are_configs_of_every_kind():
  kinds = {p.split(os.sep)[1] for p in all_configs()}
  assert {'runs', 'models', 'experiments'} <= kinds


@pytest.mark.parametrize('path', all_configs())
def test_config_parses_and_builds(path, tmp_path, classifier_data):
  bindings = []
  if path.endswith('classifier_tfrecord.gin'):  # its data, written as the README says
    bindings += classifier_data
  if path.endswith('lm_corpus.gin'):  # a few token documents in place of prepare_data's
    from layout_core.tasks.corpus import write_documents  # pylint: disable=g-import-not-at-top
    write_documents(str(tmp_path / 'train-{shard}.tfrecord'), [[5, 6, 7, 1]] * 8, num_shards=2)
    write_documents(str(tmp_path / 'eval-{shard}.tfrecord'), [[5, 6, 1]] * 2)
    bindings += [f"lm_corpus.train_files = '{tmp_path}/train-*.tfrecord'",
                 f"lm_corpus.eval_files = '{tmp_path}/eval-*.tfrecord'"]
  if path.endswith('instruct_tiny.gin'):  # a few examples in place of its one-liner's
    import json  # pylint: disable=g-import-not-at-top
    for split in ('train', 'eval'):
      (tmp_path / f'{split}.jsonl').write_text(''.join(
          json.dumps({'prompt': f'{a}+1=', 'response': str(a + 1)}) + '\n' for a in range(3)))
      bindings.append(f"instruct.{split}_files = '{tmp_path}/{split}.jsonl'")
  if path.endswith('dpo_tiny.gin'):  # a few pairs in place of its writer's
    from examples.preference.write_pairs import write_pairs  # pylint: disable=g-import-not-at-top
    written = write_pairs(str(tmp_path), num_train=4, num_eval=2)
    bindings += [f"preference.{split}_files = '{path}'" for split, path in written.items()]
  if path.endswith('lm_small.gin'):
    bindings.append('data.vocab_size = 256')  # a byte-sized vocabulary
  if 'layouts' in path:
    name = os.path.basename(path)
    mesh = LAYOUT_MESHES.get(name, "{'data': 2, 'model': 4}")  # the rules' axes
    bindings.append(f'mesh.shape = {mesh}')
    bindings += LAYOUT_MODELS[name][1] + ['layout_rules.strict = True']

  gin_setup.parse_gin(files=stack_for(path), bindings=bindings)
  plan = plan_lib.make_plan()
  assert plan.records, 'the model has no variables'
  assert plan.meta.flops > 0
  assert plan.mesh_spec.num_devices >= 1
  assert {r.path for r in plan.records} == {
      s.path for s in plan.params.cls.variable_specs(plan.params)}


def all_sweeps():
  files = glob.glob(os.path.join(REPO_ROOT, 'configs', '**', '*.sweep'), recursive=True)
  return sorted(os.path.relpath(f, REPO_ROOT) for f in files)


@pytest.mark.parametrize('path', all_sweeps())
def test_sweep_file_plans_every_trial(path):
  """A sweep file (configs/sweeps/*.sweep) reads, expands, and each trial's config
  parses and plans with its swept values in effect."""
  spec = sweep_spec.read_sweep_file(os.path.join(REPO_ROOT, path))
  settings = spec.settings
  trials = sweep_spec.expand([sweep_spec.parse_axis(a) for a in spec.sweep],
                             mode=settings.get('sweep_mode', 'product'),
                             num_trials=int(settings.get('num_trials', 0)),
                             seed=int(settings.get('seed', 0)))
  assert trials
  for trial in trials:
    gin_setup.parse_gin(files=spec.gin_file, bindings=spec.gin_bindings + trial.bindings)
    plan = plan_lib.make_plan()
    assert plan.records and plan.meta.flops > 0
    for key, text in trial.values.items():
      assert gin.query_parameter(key) == sweep_spec.literal(text), (trial.name, key)


def test_configs_are_found_from_any_directory_and_a_local_file_comes_first(
    tmp_path, monkeypatch):
  """`configs/...` names resolve in gin's order: the current directory, then
  the `configs` package that ships with meshgin, then the search paths."""
  name = 'configs/runs/train.gin'
  elsewhere = tmp_path / 'elsewhere'
  (elsewhere / 'configs' / 'runs').mkdir(parents=True)
  shadow = tmp_path / 'search' / name
  shadow.parent.mkdir(parents=True)
  shadow.write_text('train.num_steps = 1\n')
  monkeypatch.chdir(elsewhere)
  search = [str(tmp_path / 'search')]
  assert gin_setup.find_gin_file(name, search) == os.path.join(REPO_ROOT, name)
  (elsewhere / name).write_text('train.num_steps = 2\n')
  assert gin_setup.find_gin_file(name, search) == str(elsewhere / name)
  assert gin_setup.find_gin_file('configs/runs/nope.gin', search) is None
  # gin itself reads the file the walk above found (gin keeps every search path
  # it is given for the rest of the process: none is given here)
  gin_setup.parse_gin(files=[name], bindings=[], search_paths=[])
  assert gin.query_parameter('train.num_steps') == 2
  gin.clear_config()
