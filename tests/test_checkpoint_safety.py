"""Checkpoint safety on real files: what counts as damage (and what must not),
damage that keeps a file's size, a save that fails and is tried again, and a
checkpoint directory removed while a save writes its shards.

A small sharded state (a [16, 8] DVariable over 2x4 devices, so a save writes
8 device bundles in parallel, plus a plain variable) keeps these fast; the
restore is compared with the values saved, and every damage test has its
control (the same checkpoint undamaged restores as itself)."""

import json
import os
import shutil
import threading

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.experimental import dtensor

from layout_core.checkpoint import shard_io
from layout_core.checkpoint.files import checkpoint_dirs, manifest_digest, validate
from layout_core.checkpoint.manager import CheckpointConfig, Checkpointer
from layout_core.layout.mesh import pack_global_array
from layout_core.layout.variables import to_numpy


class Tiny(tf.Module):
  """A sharded weight and a plain bias, filled from `seed`."""

  def __init__(self, mesh, seed):
    super().__init__()
    rng = np.random.default_rng(seed)
    self.w = dtensor.DVariable(pack_global_array(
        rng.standard_normal((16, 8)).astype(np.float32), dtensor.Layout(['data', 'model'], mesh)))
    self.b = tf.Variable(rng.standard_normal(8).astype(np.float32))

  def values(self):
    return {'w': to_numpy(self.w), 'b': self.b.numpy()}


def checkpointer(directory, model, *, step_of_data=None, **config):
  """A Checkpointer of `model` whose data state names the step it was taken at."""
  data_state = (lambda: {'train': {'0': step_of_data[0]}}) if step_of_data else None
  return Checkpointer(directory=str(directory), state={'model': model},
                      config=CheckpointConfig(**config), data_state=data_state,
                      extra_files={'config.gin': 'train.num_steps = 10\n'})


def save_two(directory, mesh):
  """ckpt-2 and ckpt-3 of different values, each with its data state;
  returns (values at 2, values at 3)."""
  model, at = Tiny(mesh, seed=2), [2]
  saver = checkpointer(directory, model, step_of_data=at)
  saver.save(2, reason='periodic')
  first = model.values()
  model.w.assign(pack_global_array(first['w'] + 1, model.w.layout))
  at[0] = 3
  saver.save(3, reason='periodic')
  return first, model.values()


def restore(directory, mesh):
  """(restored step, restored values, restored data state) into a fresh model."""
  model = Tiny(mesh, seed=99)
  restorer = checkpointer(directory, model)
  step = restorer.restore_latest()
  return step, model.values(), restorer.restored_data_state


def assert_same(actual, expected):
  for name, value in expected.items():
    np.testing.assert_array_equal(actual[name], value, err_msg=name)


def moved_aside(directory):
  return sorted(n.split('.corrupt-')[0] for n in os.listdir(directory) if '.corrupt-' in n)


def strip_checksums(checkpoint):
  """Rewrites a manifest as written before checksums existed (no crc32 field)."""
  path = checkpoint / 'manifest.json'
  manifest = json.loads(path.read_text())
  manifest.pop('crc32', None)
  manifest['digest'] = manifest_digest(manifest)
  path.write_text(json.dumps(manifest, indent=1))


def junk_of_the_same_size(path):
  path.write_bytes(b'x' * path.stat().st_size)


# -- damage that keeps the size --------------------------------------------------------
@pytest.mark.parametrize('name', ['data_state.json', 'config.gin', 'ckpt.index'])
def test_junk_of_the_same_size_is_found_moved_aside_and_the_previous_used(
    tmp_path, mesh_2x4, name, caplog):
  directory = tmp_path / 'checkpoints'
  at_2, at_3 = save_two(directory, mesh_2x4)
  assert restore(directory, mesh_2x4)[0] == 3  # control: undamaged, the newest is used
  junk_of_the_same_size(directory / 'ckpt-3' / name)
  assert validate(str(directory / 'ckpt-3')) is None  # sizes alone cannot tell
  step, values, data_state = restore(directory, mesh_2x4)
  assert (step, data_state) == (2, {'train': {'0': 2}})
  assert_same(values, at_2)
  assert moved_aside(directory) == ['ckpt-3']
  assert f'{directory / "ckpt-3" / name} does not match its crc32' in caplog.text
  assert tf.train.latest_checkpoint(str(directory)).endswith('ckpt-2/ckpt')


@pytest.mark.parametrize('damage', ['data_state junk', 'data flipped', 'index junk'])
def test_checkpoints_written_without_checksums_restore_and_their_damage_is_found(
    tmp_path, mesh_2x4, damage, caplog):
  """Manifests from before checksums: sizes are checked, and damage the
  reader meets (TF's DataLossError, an index it cannot parse, a data state
  that is not JSON) still moves the checkpoint aside."""
  directory = tmp_path / 'checkpoints'
  at_2, at_3 = save_two(directory, mesh_2x4)
  for name in ('ckpt-2', 'ckpt-3'):
    strip_checksums(directory / name)
  step, values, data_state = restore(directory, mesh_2x4)
  assert (step, data_state) == (3, {'train': {'0': 3}})  # control: old format restores
  assert_same(values, at_3)
  newest = directory / 'ckpt-3'
  if damage == 'data_state junk':
    junk_of_the_same_size(newest / 'data_state.json')
  elif damage == 'index junk':
    junk_of_the_same_size(newest / 'ckpt.index')
  else:
    data = next(newest.glob('ckpt.data-*'))
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
  step, values, data_state = restore(directory, mesh_2x4)
  assert (step, data_state) == (2, {'train': {'0': 2}})
  assert_same(values, at_2)
  assert moved_aside(directory) == ['ckpt-3']
  assert f'Checkpoint {newest} is unusable: reading' in caplog.text


# -- a bug is not damage ---------------------------------------------------------------
def buggy_value_error(*args, **kwargs):
  raise ValueError('operands could not be broadcast together')  # a code bug


def buggy_dtype(prefix, names, specs, dtypes, device):
  """A real TF error from a wrong request, not from the files: the tensors
  asked for as float64 (they are float32)."""
  return real_restore(prefix, names, specs, [tf.float64] * len(dtypes), device)


real_restore = shard_io._restore  # pylint: disable=protected-access


@pytest.mark.parametrize('bug', [buggy_value_error, buggy_dtype])
def test_a_bug_while_restoring_propagates_and_moves_nothing(tmp_path, mesh_2x4, monkeypatch,
                                                            bug):
  directory = tmp_path / 'checkpoints'
  save_two(directory, mesh_2x4)
  before = sorted(os.listdir(directory))
  monkeypatch.setattr(shard_io, '_restore', bug)
  with pytest.raises((ValueError, tf.errors.InvalidArgumentError)):
    restore(directory, mesh_2x4)
  assert sorted(os.listdir(directory)) == before
  assert all(validate(path, check_contents=True) is None
             for _, path in checkpoint_dirs(str(directory)))
  monkeypatch.undo()
  assert restore(directory, mesh_2x4)[0] == 3  # untouched: the newest still restores


# -- a failed save is not a saved step -------------------------------------------------
@pytest.mark.parametrize('async_save', [False, True])
def test_a_save_that_failed_is_written_when_tried_again(tmp_path, mesh_2x4, async_save):
  """checkpoints/ is a file, so the save of step 4 fails; the caller goes on,
  the path is freed, and the next save of step 4 must write it."""
  directory = tmp_path / 'checkpoints'
  model = Tiny(mesh_2x4, seed=4)
  saver = checkpointer(directory, model, async_save=async_save)
  directory.write_text('not a directory')
  with pytest.raises(OSError):
    saver.save(4, reason='periodic')
    saver.wait()
  directory.unlink()
  path = saver.save(4, reason='preemption')
  saver.wait()
  assert path == str(directory / 'ckpt-4' / 'ckpt')
  assert validate(str(directory / 'ckpt-4'), check_contents=True) is None
  step, values, _ = restore(directory, mesh_2x4)
  assert step == 4
  assert_same(values, model.values())
  assert saver.save(4, reason='final') is None  # now it is saved: not written twice


# -- the directory removed while the shards are written ---------------------------------
def strike_between_shard_writes(monkeypatch, remove, *, times=1):
  """After a device bundle is on disk, `remove(temporary)` runs while the
  other writers carry on: after the first one written, and after the next
  `times - 1` (whichever save or attempt they belong to)."""
  real_write_part, lock, struck = shard_io.write_part, threading.Lock(), []

  def write_part(prefix, shard):
    real_write_part(prefix, shard)
    with lock:
      if len(struck) < times:
        struck.append(os.path.dirname(prefix))
        remove(os.path.dirname(prefix))

  monkeypatch.setattr(shard_io, 'write_part', write_part)
  return struck


def rm_rf(path):
  shutil.rmtree(path, ignore_errors=True)


@pytest.mark.parametrize('target', ['temporary directory', 'checkpoints directory'])
def test_a_directory_removed_between_shard_writes_is_written_again(
    tmp_path, mesh_2x4, monkeypatch, caplog, target):
  """The temporary directory alone (TF's SaveV2 then recreates it for the
  shards still to come, so the first ones are missing from it) or all of
  checkpoints/: either way the checkpoint is written again, complete."""
  directory = tmp_path / 'checkpoints'
  model = Tiny(mesh_2x4, seed=5)
  saver = checkpointer(directory, model)
  saver.save(1, reason='periodic')
  remove = rm_rf if target == 'temporary directory' else (
      lambda temporary: rm_rf(os.path.dirname(temporary)))
  struck = strike_between_shard_writes(monkeypatch, remove)
  path = saver.save(2, reason='periodic')
  assert struck == [str(directory / 'tmp-ckpt-2')]
  assert 'was removed while checkpoint 2 was being written' in caplog.text
  assert tf.train.latest_checkpoint(str(directory)) == path
  assert validate(str(directory / 'ckpt-2'), check_contents=True) is None
  assert not [n for n in os.listdir(directory) if n.startswith('tmp-')]
  monkeypatch.undo()
  step, values, _ = restore(directory, mesh_2x4)
  assert step == 2
  assert_same(values, model.values())


def test_a_save_whose_directory_keeps_vanishing_gives_up_clearly_and_keeps_the_last(
    tmp_path, mesh_2x4, monkeypatch):
  directory = tmp_path / 'checkpoints'
  model = Tiny(mesh_2x4, seed=6)
  saver = checkpointer(directory, model)
  saver.save(1, reason='periodic')
  saved = model.values()
  strike_between_shard_writes(monkeypatch, rm_rf, times=99)
  with pytest.raises(RuntimeError) as error:
    saver.save(2, reason='periodic')
  message = str(error.value)
  assert f'{directory / "tmp-ckpt-2"} was removed 3 times while checkpoint 2' in message
  assert f'stop whatever deletes {directory}' in message
  assert sorted(n for n in os.listdir(directory) if not n.startswith('tmp-')) == [
      'checkpoint', 'ckpt-1']
  monkeypatch.undo()
  step, values, _ = restore(directory, mesh_2x4)
  assert step == 1
  assert_same(values, saved)
