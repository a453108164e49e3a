"""Sharded, atomic, resumable checkpoints in the standard tf.train format.

    checkpointer = Checkpointer(directory=f'{model_dir}/checkpoints',
                                state={'model': model, 'optimizer': adam, 'step': step},
                                config=CheckpointConfig(every_steps=100, keep=3))
    restored = checkpointer.restore_latest()     # None on a fresh run
    ...
    checkpointer.maybe_save(step)                # periodic / every_seconds
    checkpointer.save(step, reason='final')

On disk, `checkpoints/ckpt-<step>/` holds a standard `tf.train.Checkpoint`
(`ckpt.index` + `ckpt.data-*`, readable by `tf.train.load_checkpoint`, keys
such as `model/stack/block_000/ffn/w_in/.ATTRIBUTES/VARIABLE_VALUE`) plus
`manifest.json` (step, reason, every file's size) and the run's `config.gin`,
so a checkpoint always says how to rebuild its model.

Crash safety: a checkpoint is written into a temporary directory, every file
is fsynced, and only then is the directory renamed to `ckpt-<step>` (an atomic
rename). A checkpoint is "valid" when its manifest exists and every file has
its recorded size; restore takes the newest valid one, and if reading it
still fails (a corrupt shard) it logs the file and falls back to the next
one, moving the broken one aside (`*.corrupt`) instead of deleting it. The
TF `checkpoint` state file (`tf.train.latest_checkpoint`) is updated after
the rename, so it never names a partial checkpoint either.

Saving first copies every variable's shards into host memory (one concat of
the distinct shards on /CPU:0: no relayout, nothing compiled), into host variables that mirror the
state's object graph, then writes those with a plain `Checkpoint.write`: the
same keys a DTensor checkpoint would have, at plain-checkpoint speed (DTensor's
own SaveV2 spends ~1.5 s re-expanding its save function on every call).
Restore reads each tensor by key and gives every device only its slice, so a
checkpoint restores into any mesh shape or layout. With `async_save` the
write runs in a background thread while training continues.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import threading
import time
from typing import Callable, Mapping, Sequence

import numpy as np
import tensorflow as tf
from absl import logging
from tensorflow.experimental import dtensor

from layout_core.errors import ConfigError
from layout_core.mesh import pack_global_array

_NAME = re.compile(r'^ckpt-(\d+)$')
_VALUE_SUFFIX = '/.ATTRIBUTES/VARIABLE_VALUE'


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
  every_steps: int = 100        # save every N steps (0: never periodically)
  every_seconds: float = 0.0    # also save when this long since the last save (0: off)
  keep: int = 3                 # newest checkpoints kept; older ones deleted
  save_at_end: bool = True      # save when training finishes
  async_save: bool = False      # write in a background thread (2x variable memory)
  init_from: str | None = None  # a checkpoint (or directory) to start a fresh run from
  # (regex on the new variable path, replacement) pairs: the name to read from
  # `init_from`; first fullmatch wins; unmatched paths are read under their own name.
  init_from_map: Sequence[tuple[str, str]] = ()

  def __post_init__(self):
    if self.keep < 1:
      raise ConfigError(f'checkpoint.keep is {self.keep}', fix='keep at least 1')


@dataclasses.dataclass(frozen=True)
class CheckpointEvent:
  step: int
  path: str
  reason: str        # periodic | final | preemption | resume | init_from
  seconds: float
  size_bytes: int

  def line(self) -> str:
    verb = 'restored' if self.reason in ('resume', 'init_from') else 'saved'
    return (f'step {self.step}: {verb} {self.path} ({self.reason}, '
            f'{self.size_bytes / 2**20:.1f} MiB in {self.seconds:.2f} s)')


def _fsync_tree(directory: str) -> None:
  for name in os.listdir(directory):
    with open(os.path.join(directory, name), 'rb') as f:
      os.fsync(f.fileno())
  _fsync_dir(directory)


def _fsync_dir(directory: str) -> None:
  fd = os.open(directory, os.O_RDONLY)
  try:
    os.fsync(fd)
  finally:
    os.close(fd)


def _escape(name: str) -> str:
  """A trackable child name as tf.train.Checkpoint spells it in keys."""
  return name.replace('.', '..').replace('/', '.S')


@dataclasses.dataclass(frozen=True)
class KeyRecord:
  """What one checkpoint key holds: `variable`, or `variable[index]` when the
  variable stacks several checkpoint tensors (the SPMD pipeline's cells)."""
  variable: tf.Variable
  index: tuple[int, ...] | None = None

  @property
  def shape(self) -> list[int]:
    shape = self.variable.shape.as_list()
    return shape if self.index is None else shape[len(self.index):]


_UNSTACKED = '_meshgin_unstacked'


def set_unstacked(variable: tf.Variable, placeholder: str,
                  pieces: Sequence[tuple[str, tuple[int, ...]]]) -> None:
  """Declares that `variable` stacks several checkpoint tensors: under the
  variable's own key with the path component `placeholder` replaced by
  `name`, the tensor `variable[index]`, for each (name, index) in `pieces`.
  E.g. placeholder 'stacked_cells' and ('block_003', (1, 0)):
  model/stack/stacked_cells/ffn/w_in -> model/stack/block_003/ffn/w_in = v[1, 0]."""
  setattr(variable, _UNSTACKED, (placeholder, tuple(pieces)))


def _replace_component(key: str, placeholder: str, name: str) -> str:
  """`placeholder` -> `name` where it is a whole path component of `key`
  (components are separated by '/' in keys and '.S' inside escaped names)."""
  pattern = re.compile(r'(^|/|\.S)' + re.escape(placeholder) + r'(?=/|\.S|$)')
  replaced, count = pattern.subn(lambda m: m.group(1) + name, key)
  if count != 1:
    raise ValueError(f'{placeholder!r} is {count} components of checkpoint key {key!r}')
  return replaced


def checkpoint_records(state: Mapping[str, tf.Module]) -> dict[str, KeyRecord]:
  """Checkpoint key -> what it holds, for everything `state` would save."""
  records: dict[str, KeyRecord] = {}
  seen: set[int] = set()

  def visit(prefix: str, obj) -> None:
    if isinstance(obj, tf.Variable):
      if id(obj) not in seen:
        seen.add(id(obj))
        unstacked = getattr(obj, _UNSTACKED, None)
        if unstacked is None:
          records[prefix + _VALUE_SUFFIX] = KeyRecord(obj)
        else:
          placeholder, pieces = unstacked
          for name, index in pieces:
            key = _replace_component(prefix, placeholder, name) + _VALUE_SUFFIX
            records[key] = KeyRecord(obj, tuple(index))
      return
    children = obj._trackable_children(save_type='checkpoint')  # pylint: disable=protected-access
    for name, child in children.items():
      visit(f'{prefix}/{_escape(name)}', child)

  for name, obj in state.items():
    visit(_escape(name), obj)
  return records


def checkpoint_keys(state: Mapping[str, tf.Module]) -> dict[str, tf.Variable]:
  """Checkpoint key -> variable for everything `state` would save (for a
  stacked variable, every key it holds maps to the whole variable; use
  `checkpoint_records` for the slice)."""
  return {key: record.variable for key, record in checkpoint_records(state).items()}


def gather_to_host(variable: tf.Variable) -> tf.Tensor:
  """The global value of a (D)Variable as one tensor on the host CPU.

  Built by concatenating one copy of each distinct shard on /CPU:0: no
  relayout, no collective, nothing for DTensor to compile. (Going through
  numpy is ~20x slower: each shard's .numpy() leaves its virtual device
  slowly.) Needs every shard to be local: true for single-client meshes.
  """
  layout = getattr(variable, 'layout', None)
  if layout is None:
    return variable.read_value()
  if layout.mesh.num_local_devices() != layout.mesh.size:
    raise NotImplementedError('saving a mesh that spans several clients')
  axes = dict(zip(layout.mesh.dim_names, layout.mesh.shape()))
  specs = layout.sharding_specs
  counts = [1 if a == dtensor.UNSHARDED else axes[a] for a in specs]
  pieces = {}
  for shard, location in zip(dtensor.unpack(variable.read_value()),
                             layout.mesh.local_device_locations()):
    key = tuple(0 if a == dtensor.UNSHARDED else location[a] for a in specs)
    pieces.setdefault(key, shard)

  def build(prefix: tuple[int, ...], dim: int) -> tf.Tensor:
    if dim == len(counts):
      return pieces[prefix]
    parts = [build(prefix + (i,), dim + 1) for i in range(counts[dim])]
    return parts[0] if len(parts) == 1 else tf.concat(parts, axis=dim)

  with tf.device('/CPU:0'):
    return tf.identity(build((), 0))


def _unescape(component: str) -> str:
  """Inverse of `_escape`."""
  out, i = [], 0
  while i < len(component):
    if component[i] == '.' and i + 1 < len(component):
      out.append('/' if component[i + 1] == 'S' else component[i + 1])
      i += 2
    else:
      out.append(component[i])
      i += 1
  return ''.join(out)


def _host_tree(records: Mapping[str, KeyRecord]):
  """Root name -> a trackable tree whose checkpoint keys are exactly those of
  `records`, holding one host variable per key; plus (record, host) pairs."""
  roots: dict = {}
  nodes: dict = {}  # path parts -> node
  pairs = []
  for key, record in records.items():
    parts = [_unescape(p) for p in key[:-len(_VALUE_SUFFIX)].split('/')]
    with tf.device('/CPU:0'):
      host = tf.Variable(tf.zeros(record.shape, record.variable.dtype), trainable=False)
    pairs.append((record, host))
    if parts[0] not in roots:
      roots[parts[0]] = nodes[(parts[0],)] = tf.__internal__.tracking.AutoTrackable()
    node = roots[parts[0]]
    for depth in range(2, len(parts)):
      child = nodes.get(tuple(parts[:depth]))
      if child is None:
        child = nodes[tuple(parts[:depth])] = tf.__internal__.tracking.AutoTrackable()
        node._track_trackable(child, name=parts[depth - 1])  # pylint: disable=protected-access
      node = child
    node._track_trackable(host, name=parts[-1])  # pylint: disable=protected-access
  return roots, pairs


def restore_values(prefix: str, records: Mapping[str, KeyRecord]) -> None:
  """Assigns every variable from the checkpoint by key, into its own layout
  (a stacked variable from all its slices at once)."""
  reader = tf.train.load_checkpoint(prefix)
  stacked: dict[int, tuple[tf.Variable, np.ndarray]] = {}
  for key, record in records.items():
    if record.index is None:
      assign_global(record.variable, reader.get_tensor(key))
      continue
    variable = record.variable
    if id(variable) not in stacked:
      stacked[id(variable)] = (variable, np.zeros(variable.shape.as_list(),
                                                  variable.dtype.as_numpy_dtype))
    stacked[id(variable)][1][record.index] = reader.get_tensor(key)
  for variable, value in stacked.values():
    assign_global(variable, value)


def assign_global(variable: tf.Variable, value: np.ndarray) -> None:
  """Sets a (D)Variable from its global value; each device gets only its slice."""
  layout = getattr(variable, 'layout', None)
  variable.assign(pack_global_array(value, layout) if layout is not None else value)


def resolve_checkpoint_path(path: str) -> str:
  """A checkpoint prefix from a prefix, a ckpt-N directory or a model_dir."""
  if tf.io.gfile.exists(path + '.index'):
    return path
  for candidate in (os.path.join(path, 'ckpt'), os.path.join(path, 'checkpoints')):
    if tf.io.gfile.exists(candidate + '.index'):
      return candidate
    if os.path.isdir(candidate):
      found = latest_valid(candidate)
      if found:
        return found[1]
  latest = tf.train.latest_checkpoint(path)
  if latest:
    return latest
  raise ConfigError(f'no checkpoint found at {path!r}',
                    where='checkpoint.init_from',
                    fix='give a checkpoint prefix, a ckpt-N directory or a model_dir')


def _directory_size(directory: str) -> int:
  return sum(os.path.getsize(os.path.join(directory, n)) for n in os.listdir(directory))


def validate(directory: str) -> str | None:
  """None if `directory` is a complete checkpoint, else what is wrong with it."""
  manifest_path = os.path.join(directory, 'manifest.json')
  if not os.path.isfile(manifest_path):
    return f'{manifest_path} is missing (an interrupted save?)'
  try:
    manifest = json.load(open(manifest_path))
  except ValueError as e:
    return f'{manifest_path} is unreadable: {e}'
  for name, size in manifest['files'].items():
    path = os.path.join(directory, name)
    if not os.path.isfile(path):
      return f'{path} is missing'
    actual = os.path.getsize(path)
    if actual != size:
      return f'{path} is {actual} bytes but the manifest says {size} (truncated or corrupt)'
  return None


def checkpoint_dirs(directory: str) -> list[tuple[int, str]]:
  """(step, path) of every ckpt-N directory, newest first."""
  if not os.path.isdir(directory):
    return []
  found = []
  for name in os.listdir(directory):
    match = _NAME.match(name)
    if match:
      found.append((int(match.group(1)), os.path.join(directory, name)))
  return sorted(found, reverse=True)


def latest_valid(directory: str) -> tuple[int, str] | None:
  """(step, prefix) of the newest checkpoint that passes `validate`."""
  for step, path in checkpoint_dirs(directory):
    if validate(path) is None:
      return step, os.path.join(path, 'ckpt')
  return None


class Checkpointer:
  """Saves and restores `state` under `directory` (see module docstring)."""

  def __init__(self, *, directory: str, state: Mapping[str, tf.Module],
               config: CheckpointConfig, extra_files: Mapping[str, str] | None = None,
               on_event: Callable[[CheckpointEvent], None] | None = None):
    self.directory = directory
    self.config = config
    self.state = dict(state)
    self.extra_files = dict(extra_files or {})
    self.on_event = on_event or (lambda event: None)
    self._host = None  # (host checkpoint, [(variable, host variable)]), built lazily
    self._last_save_time = time.monotonic()
    self._last_saved_step: int | None = None
    self._thread: threading.Thread | None = None
    self._thread_error: BaseException | None = None
    os.makedirs(directory, exist_ok=True)
    for name in os.listdir(directory):
      if name.startswith('tmp-'):  # left by a save that was killed: never valid
        shutil.rmtree(os.path.join(directory, name), ignore_errors=True)

  # -- restore -----------------------------------------------------------------------
  def check_compatible(self, prefix: str) -> None:
    """ConfigError listing every variable whose name or shape does not match."""
    saved = dict(tf.train.list_variables(prefix))
    expected = checkpoint_records(self.state)
    missing, reshaped, extra = [], [], []
    for key, record in expected.items():
      if key not in saved:
        missing.append(key)
      elif list(saved[key]) != record.shape:
        reshaped.append(f'{key}: checkpoint shape {list(saved[key])}, model shape '
                        f'{record.shape}')
    roots = tuple(_escape(name) + '/' for name in self.state)
    extra = [k for k in saved if k.startswith(roots) and k.endswith(_VALUE_SUFFIX)
             and k not in expected]
    if missing or reshaped or extra:
      def listing(items):
        return '; '.join(items[:4]) + (f'; ... {len(items) - 4} more' if len(items) > 4 else '')
      raise ConfigError(
          f'the checkpoint {prefix} does not match this model: {len(reshaped)} '
          f'variable(s) with other shapes [{listing(reshaped)}], {len(missing)} missing '
          f'from the checkpoint [{listing(missing)}], {len(extra)} only in the '
          f'checkpoint [{listing(extra)}]', where='model_dir',
          fix='use a new --model_dir for a different model (the existing '
              'checkpoint was left untouched)')

  def restore_latest(self) -> int | None:
    """Restores the newest readable checkpoint; returns its step or None."""
    for step, path in checkpoint_dirs(self.directory):
      problem = validate(path)
      prefix = os.path.join(path, 'ckpt')
      if problem is None:
        self.check_compatible(prefix)
        start = time.perf_counter()
        try:
          restore_values(prefix, checkpoint_records(self.state))
        except (tf.errors.OpError, ValueError) as e:
          problem = f'reading {prefix} failed: {type(e).__name__}: {str(e).splitlines()[0]}'
        else:
          self._last_saved_step = step
          self.on_event(CheckpointEvent(step, prefix, 'resume',
                                        time.perf_counter() - start, _directory_size(path)))
          logging.info('Resumed from %s at step %d', prefix, step)
          return step
      aside = f'{path}.corrupt-{int(time.time())}'
      logging.error('Checkpoint %s is unusable: %s. Moved it to %s and trying the '
                    'previous one.', path, problem, aside)
      os.rename(path, aside)
    return None

  def init_from(self, source: str, variables: Mapping[str, tf.Variable]) -> int:
    """Reads `variables` (path -> variable) by name from another checkpoint.

    Works for object-graph checkpoints (meshgin's, keyed 'model/...') and
    name-based TF1 checkpoints (tf.compat.v1.train.Saver, keyed by variable
    name). Returns the number of variables read.
    """
    prefix = resolve_checkpoint_path(source)
    start = time.perf_counter()
    reader = tf.train.load_checkpoint(prefix)
    shapes = reader.get_variable_to_shape_map()
    by_name = {k[:-len(_VALUE_SUFFIX)] if k.endswith(_VALUE_SUFFIX) else k: k
               for k in shapes}
    rules = [(re.compile(pattern), replacement)
             for pattern, replacement in self.config.init_from_map]
    missing, wrong_shape, loaded = [], [], 0
    for path, variable in variables.items():
      name = path
      for pattern, replacement in rules:
        match = pattern.fullmatch(path)
        if match:
          name = match.expand(replacement)
          break
      root_relative = 'model/' + name.split('/', 1)[-1]
      key = by_name.get(name) or by_name.get(root_relative)
      if key is None:
        missing.append(f'{path} (looked for {name!r})')
        continue
      if list(shapes[key]) != variable.shape.as_list():
        wrong_shape.append(f'{path}: {list(shapes[key])} vs {variable.shape.as_list()}')
        continue
      assign_global(variable, reader.get_tensor(key))
      loaded += 1
    if missing or wrong_shape:
      raise ConfigError(
          f'checkpoint.init_from {prefix}: {len(missing)} variable(s) not found '
          f'[{"; ".join(missing[:8])}] and {len(wrong_shape)} with other shapes '
          f'[{"; ".join(wrong_shape[:8])}]', where='checkpoint.init_from_map',
          fix='add (regex, replacement) pairs mapping new paths to the names in '
              'the checkpoint (tf.train.list_variables shows them)')
    self.on_event(CheckpointEvent(0, prefix, 'init_from', time.perf_counter() - start,
                                  sum(int(np.prod(s)) * 4 for s in shapes.values())))
    logging.info('Initialised %d variables from %s', loaded, prefix)
    return loaded

  # -- save ----------------------------------------------------------------------------
  def maybe_save(self, step: int) -> bool:
    config = self.config
    due = (config.every_steps and step % config.every_steps == 0) or (
        config.every_seconds and
        time.monotonic() - self._last_save_time >= config.every_seconds)
    if due:
      self.save(step, reason='periodic')
    return bool(due)

  def save(self, step: int, *, reason: str) -> str | None:
    """Writes checkpoint `step` (async if configured); returns its final path."""
    self.wait()
    if step == self._last_saved_step:
      return None
    self._last_saved_step = step
    self._last_save_time = time.monotonic()
    final = os.path.join(self.directory, f'ckpt-{step}')
    if os.path.exists(final):  # a broken one that was never moved aside
      os.rename(final, f'{final}.corrupt-{int(time.time())}')
    temporary = os.path.join(self.directory, f'tmp-ckpt-{step}-{os.getpid()}')
    start = time.perf_counter()
    checkpoint = self._snapshot()
    if self.config.async_save:
      self._thread = threading.Thread(
          target=self._write_guarded, args=(checkpoint, temporary, final, step, reason, start),
          name=f'checkpoint-{step}', daemon=False)
      self._thread.start()
    else:
      self._write(checkpoint, temporary, final, step, reason, start)
    return os.path.join(final, 'ckpt')

  def wait(self) -> None:
    """Blocks until an async save in flight is on disk; re-raises its error."""
    if self._thread is not None:
      self._thread.join()
      self._thread = None
    if self._thread_error is not None:
      error, self._thread_error = self._thread_error, None
      raise error

  def _snapshot(self) -> tf.train.Checkpoint:
    """Copies every variable into host memory; training may then go on."""
    if self._host is None:
      roots, pairs = _host_tree(checkpoint_records(self.state))
      self._host = (tf.train.Checkpoint(**roots), pairs)
    checkpoint, pairs = self._host
    gathered: dict[int, tf.Tensor] = {}
    for record, host in pairs:
      variable = record.variable
      if id(variable) not in gathered:
        gathered[id(variable)] = gather_to_host(variable)
      value = gathered[id(variable)]
      host.assign(value if record.index is None else value[record.index])
    return checkpoint

  def _write_guarded(self, *args) -> None:
    try:
      self._write(*args)
    except BaseException as e:  # pylint: disable=broad-except  # surfaced by wait()
      self._thread_error = e

  def _write(self, checkpoint: tf.train.Checkpoint, temporary: str, final: str,
             step: int, reason: str, start: float) -> None:
    os.makedirs(temporary)
    checkpoint.write(os.path.join(temporary, 'ckpt'))
    for name, text in self.extra_files.items():
      with open(os.path.join(temporary, name), 'w') as f:
        f.write(text)
    files = {n: os.path.getsize(os.path.join(temporary, n)) for n in os.listdir(temporary)}
    with open(os.path.join(temporary, 'manifest.json'), 'w') as f:
      json.dump({'step': step, 'reason': reason, 'files': files}, f, indent=1)
    _fsync_tree(temporary)
    os.rename(temporary, final)  # the commit point
    _fsync_dir(self.directory)
    event = CheckpointEvent(step, os.path.join(final, 'ckpt'), reason,
                            time.perf_counter() - start, _directory_size(final))
    self._prune()
    self._update_state_file()
    logging.info('Saved checkpoint %s at step %d (%s, %.2f s)', event.path, step,
                 reason, event.seconds)
    self.on_event(event)

  def _update_state_file(self) -> None:
    valid = [os.path.join(os.path.basename(p), 'ckpt')
             for _, p in reversed(checkpoint_dirs(self.directory)) if validate(p) is None]
    if valid:  # the text format tf.train.latest_checkpoint reads; replaced atomically
      text = f'model_checkpoint_path: "{valid[-1]}"\n' + ''.join(
          f'all_model_checkpoint_paths: "{path}"\n' for path in valid)
      temporary = os.path.join(self.directory, 'checkpoint.tmp')
      with open(temporary, 'w') as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
      os.replace(temporary, os.path.join(self.directory, 'checkpoint'))

  def _prune(self) -> None:
    valid = [(s, p) for s, p in checkpoint_dirs(self.directory) if validate(p) is None]
    for _, path in valid[self.config.keep:]:
      shutil.rmtree(path, ignore_errors=True)
