"""Checkpoints on real files: exact restore across meshes and layouts, async
saves, init_from (also from a TF1 name-based checkpoint), bad input."""

import json
import os
import re
import shutil

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.experimental import dtensor

from layout_core.checkpoint import manager as checkpoint_lib
from layout_core.checkpoint import shard_io
from layout_core.checkpoint.manager import CheckpointConfig, Checkpointer
from layout_core.tasks.lm import MarkovTask
from layout_core.errors import ConfigError
from layout_core.model.lm import transformer_lm_params
from layout_core.layout.mesh import MeshSpec, build_mesh, pack_global_array
from layout_core.optim import OptimizerConfig
from layout_core.layout.rules import LayoutRules
from layout_core.train.config import TrainConfig
from layout_core.run import make_trainer
from layout_core.layout.variables import to_numpy
from tests.test_layout_scope import MEGATRON


def lm_trainer(mesh, rules=None, num_layers=2, model_dim=32):
  lm = transformer_lm_params(vocab_size=32, model_dim=model_dim, num_heads=4, ffn_dim=64,
                             num_layers=num_layers, max_len=16)
  return make_trainer(model=lm, mesh=mesh, rules=LayoutRules(rules or []),
                 task=MarkovTask(vocab_size=32, seq_len=16, seed=3),
                 optimizer=OptimizerConfig(learning_rate=1e-2, warmup_steps=0),
                 config=TrainConfig(num_steps=3, batch_size=8, log_every=1,
                                    eval_every=0, eval_batches=1))


def values(trainer):
  return {k: to_numpy(v) for k, v in checkpoint_lib.checkpoint_keys(trainer.state()).items()}


def saved(tmp_path, trainer, **config):
  events = []
  checkpointer = Checkpointer(directory=str(tmp_path / 'checkpoints'), state=trainer.state(),
                              config=CheckpointConfig(**config), on_event=events.append)
  return checkpointer, events


@pytest.fixture(scope='module')
def trained(mesh_2x4):
  trainer = lm_trainer(mesh_2x4, MEGATRON)
  trainer.train()
  return trainer


def test_save_is_standard_and_restores_exactly_into_other_meshes_and_layouts(
    tmp_path, trained, mesh_data8):
  checkpointer, events = saved(tmp_path, trained)
  path = checkpointer.save(3, reason='final')
  reader = tf.train.load_checkpoint(path)  # the standard format
  expected = values(trained)
  assert set(reader.get_variable_to_shape_map()) >= set(expected)
  assert expected['counters/step/.ATTRIBUTES/VARIABLE_VALUE'] == 3
  assert any(k.startswith('optimizer/m/lm.Sstack') for k in expected)  # slots saved
  assert events[-1].reason == 'final' and events[-1].size_bytes > 0

  four = build_mesh(MeshSpec(shape={'data': 4}))
  for mesh, rules in ((mesh_data8, None), (four, None), (mesh_data8, [(r'.*/ffn/w_in', ('data', 'unsharded'))])):
    fresh = lm_trainer(mesh, rules)
    restorer, restore_events = saved(tmp_path, fresh)
    assert restorer.restore_latest() == 3
    for key, value in values(fresh).items():
      np.testing.assert_array_equal(value, expected[key], err_msg=key)
    assert restore_events[-1].reason == 'resume'
    assert fresh.current_step == 3


def test_async_save_writes_the_same_checkpoint(tmp_path, trained):
  sync, _ = saved(tmp_path / 'sync', trained)
  asynchronous, _ = saved(tmp_path / 'async', trained, async_save=True)
  a = sync.save(3, reason='periodic')
  b = asynchronous.save(3, reason='periodic')
  asynchronous.wait()
  ra, rb = tf.train.load_checkpoint(a), tf.train.load_checkpoint(b)
  assert ra.get_variable_to_shape_map() == rb.get_variable_to_shape_map()
  for key in ra.get_variable_to_shape_map():
    np.testing.assert_array_equal(ra.get_tensor(key), rb.get_tensor(key), err_msg=key)


def test_saves_recreate_what_was_removed_underneath_them(tmp_path, trained, monkeypatch,
                                                         caplog):
  """checkpoints/ removed between saves, the newest checkpoint removed, and
  checkpoints/ removed in the middle of a save: every next save works, and the
  state file names only checkpoints that exist."""
  checkpointer, _ = saved(tmp_path, trained, keep=5)
  directory = tmp_path / 'checkpoints'
  checkpointer.save(1, reason='periodic')
  shutil.rmtree(directory)
  checkpointer.save(2, reason='periodic')
  checkpointer.save(3, reason='periodic')
  shutil.rmtree(directory / 'ckpt-3')
  checkpointer.save(4, reason='periodic')
  assert f'{directory / "ckpt-3"}, listed in' in caplog.text
  assert 'was removed by something else' in caplog.text
  state = tf.train.get_checkpoint_state(str(directory))
  assert [os.path.basename(os.path.dirname(p)) for p in state.all_model_checkpoint_paths] == [
      'ckpt-2', 'ckpt-4']

  write_shards = shard_io.write_shards
  cleaned = []

  def cleaner_strikes_mid_save(writes, *, directory, client_id):
    if not cleaned:
      cleaned.append(directory)
      shutil.rmtree(os.path.dirname(directory))  # all of checkpoints/, temporary included
    return write_shards(writes, directory=directory, client_id=client_id)
  monkeypatch.setattr(shard_io, 'write_shards', cleaner_strikes_mid_save)
  path = checkpointer.save(5, reason='periodic')
  assert 'was removed while checkpoint 5 was being written' in caplog.text
  assert sorted(os.listdir(directory)) == ['checkpoint', 'ckpt-5']
  assert tf.train.latest_checkpoint(str(directory)) == path
  reader = tf.train.load_checkpoint(path)
  for key, value in values(trained).items():
    np.testing.assert_array_equal(reader.get_tensor(key), value, err_msg=key)


def test_a_save_the_state_check_refuses_writes_nothing(tmp_path, trained):
  def diverged():
    raise FloatingPointError('train loss is nan at step 3')
  checkpointer = Checkpointer(directory=str(tmp_path / 'checkpoints'), state=trained.state(),
                              config=CheckpointConfig(), check_state=diverged)
  with pytest.raises(FloatingPointError, match='at step 3'):
    checkpointer.save(3, reason='preemption')
  assert not (tmp_path / 'checkpoints').exists()


def test_keep_prunes_old_checkpoints_and_state_file_names_latest(tmp_path, trained):
  checkpointer, _ = saved(tmp_path, trained, keep=2)
  for step in (1, 2, 3):
    checkpointer.save(step, reason='periodic')
  directory = str(tmp_path / 'checkpoints')
  assert sorted(os.listdir(directory)) == ['checkpoint', 'ckpt-2', 'ckpt-3']
  assert tf.train.latest_checkpoint(directory).endswith('ckpt-3/ckpt')


def two_checkpoints(tmp_path, trained):
  """Saves steps 2 and 3 of the same state; returns ckpt-3's directory."""
  checkpointer, _ = saved(tmp_path, trained)
  checkpointer.save(2, reason='periodic')
  checkpointer.save(3, reason='periodic')
  return tmp_path / 'checkpoints' / 'ckpt-3'


def truncate(path):
  with open(path, 'r+b') as f:
    f.truncate(os.path.getsize(path) // 3)


def garbage(path):
  """Same size, random bytes: only a content check can tell."""
  path.write_bytes(np.random.default_rng(0).bytes(os.path.getsize(path)))


def flip(path):
  """One byte in the middle inverted: same size, almost the same content."""
  raw = bytearray(path.read_bytes())
  raw[len(raw) // 2] ^= 0xFF
  path.write_bytes(bytes(raw))


FILES = {'data': lambda d: next(d.glob('ckpt.data-*')), 'index': lambda d: d / 'ckpt.index',
         'manifest': lambda d: d / 'manifest.json'}
DAMAGE = {'truncated': truncate, 'garbage': garbage, 'flipped byte': flip}


@pytest.mark.parametrize('damage', DAMAGE)
@pytest.mark.parametrize('file', FILES)
def test_damaged_checkpoint_is_reported_moved_aside_and_the_previous_used(
    tmp_path, trained, mesh_data8, file, damage, caplog):
  newest = two_checkpoints(tmp_path, trained)
  damaged = FILES[file](newest)
  DAMAGE[damage](damaged)
  fresh = lm_trainer(mesh_data8)
  restorer, _ = saved(tmp_path, fresh)
  assert restorer.restore_latest() == 2
  expected = values(trained)
  for key, value in values(fresh).items():
    np.testing.assert_array_equal(value, expected[key], err_msg=key)
  assert not newest.exists()
  assert any(n.startswith('ckpt-3.corrupt-') for n in os.listdir(newest.parent))
  report = caplog.text
  assert 'ckpt-3 is unusable' in report
  assert damaged.name in report or 'manifest' in report or 'reading' in report
  assert tf.train.latest_checkpoint(str(newest.parent)).endswith('ckpt-2/ckpt')


@pytest.mark.parametrize('damage', DAMAGE)
def test_damaged_state_file_is_moved_aside_and_written_anew(tmp_path, trained, mesh_data8,
                                                            damage, caplog):
  newest = two_checkpoints(tmp_path, trained)
  state_file = newest.parent / 'checkpoint'
  DAMAGE[damage](state_file)
  restorer, _ = saved(tmp_path, lm_trainer(mesh_data8))
  assert restorer.restore_latest() == 3  # the checkpoints themselves are fine
  assert 'state file' in caplog.text and 'damaged' in caplog.text
  assert any(n.startswith('checkpoint.corrupt-') for n in os.listdir(newest.parent))
  assert tf.train.latest_checkpoint(str(newest.parent)).endswith('ckpt-3/ckpt')


def test_a_runtime_error_while_restoring_moves_nothing(tmp_path, trained, mesh_data8,
                                                       monkeypatch):
  """Out of memory while reading is not damage: the good checkpoint stays."""
  from layout_core.checkpoint import shard_io  # pylint: disable=import-outside-toplevel
  newest = two_checkpoints(tmp_path, trained)
  before = sorted(os.listdir(newest.parent))

  def out_of_memory(*args, **kwargs):
    raise tf.errors.ResourceExhaustedError(None, None, 'OOM when allocating tensor')

  monkeypatch.setattr(shard_io, '_restore', out_of_memory)
  restorer, _ = saved(tmp_path, lm_trainer(mesh_data8))
  with pytest.raises(tf.errors.ResourceExhaustedError):
    restorer.restore_latest()
  assert sorted(os.listdir(newest.parent)) == before


def test_incompatible_model_is_rejected_and_checkpoint_untouched(tmp_path, trained, mesh_data8):
  checkpointer, _ = saved(tmp_path, trained)
  checkpointer.save(3, reason='final')
  directory = tmp_path / 'checkpoints' / 'ckpt-3'
  before = {n: (directory / n).read_bytes() for n in os.listdir(directory)}
  other = lm_trainer(mesh_data8, num_layers=3, model_dim=64)
  restorer, _ = saved(tmp_path, other)
  with pytest.raises(ConfigError) as e:
    restorer.restore_latest()
  message = str(e.value)
  assert 'does not match this model' in message
  assert 'model/emb/table/.ATTRIBUTES/VARIABLE_VALUE: checkpoint shape [32, 32], model shape [32, 64]' in message
  assert 'missing from the checkpoint' in message  # block_002
  assert {n: (directory / n).read_bytes() for n in os.listdir(directory)} == before


def test_init_from_with_path_mapping(tmp_path, trained, mesh_data8):
  checkpointer, _ = saved(tmp_path / 'old', trained)
  checkpointer.save(3, reason='final')
  renamed = lm_trainer(mesh_data8)
  mapping = [(r'lm/stack/block_(\d+)/(.*)', r'lm/stack/block_\1/\2')]
  target, events = saved(tmp_path / 'new', renamed, init_from=str(tmp_path / 'old'),
                         init_from_map=mapping)
  assert target.init_from(str(tmp_path / 'old'), renamed.engine.variables) == len(renamed.engine.variables)
  for path, variable in renamed.engine.variables.items():
    np.testing.assert_array_equal(to_numpy(variable), to_numpy(trained.engine.variables[path]))
  assert renamed.current_step == 0 and events[-1].reason == 'init_from'


def test_init_from_tf1_name_based_checkpoint(tmp_path, mesh_2x4):
  """A tf.compat.v1.train.Saver checkpoint (no object graph), read by name."""
  model = lm_trainer(mesh_2x4, MEGATRON)
  expected = {}
  with tf.Graph().as_default():
    for path, variable in model.engine.variables.items():
      value = np.random.RandomState(len(path)).randn(*variable.shape).astype(np.float32)
      expected[path] = value
      tf.compat.v1.get_variable(f'old_{path}', initializer=value)
    saver = tf.compat.v1.train.Saver()
    with tf.compat.v1.Session() as session:
      session.run(tf.compat.v1.global_variables_initializer())
      prefix = saver.save(session, str(tmp_path / 'tf1' / 'model.ckpt'))
  target, _ = saved(tmp_path, model, init_from_map=[(r'(.*)', r'old_\1')])
  target.init_from(prefix, model.engine.variables)
  for path, variable in model.engine.variables.items():
    np.testing.assert_array_equal(to_numpy(variable), expected[path], err_msg=path)
  bad, _ = saved(tmp_path, model)
  with pytest.raises(ConfigError, match=r"not found \[lm/emb/table \(looked for 'lm/emb/table'\)"):
    bad.init_from(prefix, model.engine.variables)


def test_interrupted_save_leaves_no_valid_checkpoint(tmp_path, trained):
  checkpointer, _ = saved(tmp_path, trained)
  checkpointer.save(2, reason='periodic')
  partial = tmp_path / 'checkpoints' / 'ckpt-5'
  partial.mkdir()
  (partial / 'ckpt.index').write_bytes(b'half')  # no manifest: never committed
  assert checkpoint_lib.latest_valid(str(tmp_path / 'checkpoints'))[0] == 2
  manifest = json.loads((tmp_path / 'checkpoints' / 'ckpt-2' / 'manifest.json').read_text())
  assert manifest['step'] == 2 and 'ckpt.index' in manifest['files']


def index_entries(prefix):
  """(key, shape) of every entry in the checkpoint index, as TF's own reader
  lists them: a sliced tensor shows one entry per stored slice."""
  listing = tf.train.load_checkpoint(prefix).debug_string().decode('latin-1')
  entries = []  # a slice's key embeds binary slice bounds (maybe newlines): match across
  for match in re.finditer(r'((?:model|optimizer|counters)/[\w./]*?/\.ATTRIBUTES/'
                           r'VARIABLE_VALUE).{0,64}?\((DT_\w+)\) \[([\d,]*)\]', listing, re.S):
    entries.append((match.group(1), tuple(int(d) for d in match.group(3).split(',') if d)))
  return entries


def test_sharded_variables_are_stored_as_slices_with_exact_values(tmp_path, trained):
  checkpointer, _ = saved(tmp_path, trained)
  path = checkpointer.save(3, reason='final')
  entries = index_entries(path)
  reader = tf.train.load_checkpoint(path)
  checked = 0
  for key, variable in checkpoint_lib.checkpoint_keys(trained.state()).items():
    stored = [shape for k, shape in entries if k == key]
    layout = getattr(variable, 'layout', None)
    shard = tuple(dtensor.unpack(variable.read_value())[0].shape) if layout else None
    if layout is not None and not layout.is_fully_replicated():
      # e.g. Megatron's w_in [d, f] on 2x4: 4 slices ('model'), not 8 ('data' replicates)
      axes = dict(zip(layout.mesh.dim_names, layout.mesh.shape()))
      distinct = int(np.prod([axes[a] for a in layout.sharding_specs if a in axes]))
      assert stored == [shard] * distinct, (key, stored)
      checked += 1
    else:
      assert stored == [tuple(variable.shape)], (key, stored)
    np.testing.assert_array_equal(reader.get_tensor(key), to_numpy(variable), err_msg=key)
  assert checked >= 6  # parameters and both Adam slots of the sharded weights

  # Still an ordinary object-graph checkpoint: TF's own restore reads it too.
  fresh = lm_trainer(build_mesh(MeshSpec(shape={'data': 4})))
  tf.train.Checkpoint(model=fresh.engine.model_state).read(path).assert_existing_objects_matched()
  for key, variable in checkpoint_lib.checkpoint_keys({'model': fresh.engine.model_state}).items():
    np.testing.assert_array_equal(to_numpy(variable), reader.get_tensor(key), err_msg=key)


def test_rows_of_a_stacked_variable_save_and_restore_under_their_own_keys(tmp_path, mesh_2x4):
  """A [4, 8, 16] variable stored as 4 keys (one per dim-0 row), as a
  stage-stacked pipeline variable is; restored into another layout."""
  value = np.arange(4 * 8 * 16, dtype=np.float32).reshape(4, 8, 16)
  stacked = dtensor.DVariable(pack_global_array(
      value, dtensor.Layout(['data', 'unsharded', 'model'], mesh_2x4)))
  entries = [shard_io.CheckpointEntry(f'stack/row_{i}', stacked, index=(i,)) for i in range(4)]
  directory = str(tmp_path)
  writes = shard_io.snapshot(entries, client_id=0)
  shard_io.write_shards(writes, directory=directory, client_id=0)
  shard_io.merge_parts(shard_io.find_parts(directory), prefix=f'{directory}/ckpt')
  reader = tf.train.load_checkpoint(f'{directory}/ckpt')
  assert reader.get_variable_to_shape_map() == {f'stack/row_{i}': [8, 16] for i in range(4)}
  for i in range(4):
    np.testing.assert_array_equal(reader.get_tensor(f'stack/row_{i}'), value[i])

  target = dtensor.DVariable(pack_global_array(
      np.zeros_like(value), dtensor.Layout(['model', 'data', 'unsharded'], mesh_2x4)))
  shard_io.read_entries(f'{directory}/ckpt', [
      shard_io.CheckpointEntry(f'stack/row_{i}', target, index=(i,)) for i in range(4)])
  np.testing.assert_array_equal(to_numpy(target), value)
