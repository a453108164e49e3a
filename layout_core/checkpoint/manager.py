"""Sharded, atomic, resumable checkpoints in the standard tf.train format.

    checkpointer = Checkpointer(directory=f'{model_dir}/checkpoints',
                                state=trainer.state(),   # model, optimizer, counters
                                config=CheckpointConfig(every_steps=100, keep=3))
    restored = checkpointer.restore_latest()     # None on a fresh run
    ...
    checkpointer.maybe_save(step)                # periodic / every_seconds
    checkpointer.save(step, reason='final')

On disk, `checkpoints/ckpt-<step>/` holds a standard `tf.train.Checkpoint`
(`ckpt.index` + `ckpt.data-*`, readable by `tf.train.load_checkpoint` and
`tf.train.Checkpoint.read`, keys such as
`model/stack/block_000/ffn/w_in/.ATTRIBUTES/VARIABLE_VALUE`) plus
`manifest.json` (step, reason, every file's size and crc32) and the run's
`config.gin`, so a checkpoint always says how to rebuild its model. A run
started from `init_from` with frozen weights (LoRA, `train.trainable`)
saves all but those, and `base.json` naming the checkpoint that holds them
(`layout_core.checkpoint.frozen_base`); restore reads them from there.

Written where the shards live (`layout_core.checkpoint.shard_io`): every device writes
the distinct shards it holds, as slices of the global tensors, into a bundle
of its own; one `MergeV2Checkpoints` joins the bundles (renaming their data
files, copying no tensor bytes). Nothing is gathered on a host, so a save
needs no more extra memory than write buffers, and in a multi-client run each
client writes only its own shards (clients need a shared filesystem; the
checkpointer checks that every client sees the directory). Restore reads only
the slice each device needs, so a checkpoint restores into any mesh shape or
layout, and into any number of clients.

Crash safety: a checkpoint is written into a temporary directory, every file
is fsynced, and only then is the directory renamed to `ckpt-<step>` (an atomic
rename, by client 0 after every client has written). A checkpoint is "valid"
when its manifest exists and every file has its recorded size
(`layout_core.checkpoint.files`); restore takes the newest valid one whose
files also match their checksums, and if it is damaged after all (a checksum
or a read that fails on any client; `layout_core.checkpoint.damage` says what
counts) it logs the file and falls back to the next one, moving the broken one
aside (`*.corrupt-<time>`) instead of deleting it. Any other error while
restoring (a bug, out of memory) propagates and moves nothing. The TF
`checkpoint` state file (`layout_core.checkpoint.state_file`) is rewritten
after the rename, so it never names a partial checkpoint either. A single
client whose directory is removed while it writes (an `rm -rf` of
checkpoints/ racing the save) writes the checkpoint again, from the same
snapshot, into a fresh directory. With `async_save` the write runs in a
background thread while training continues (single-client runs; several
clients save in step, since the commit needs a barrier between them).
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import shutil
import threading
import time
from typing import Callable, Collection, Mapping

from absl import logging

from layout_core.checkpoint import shard_io
# Re-exported: the checkpointer's settings and events are part of its API.
from layout_core.checkpoint.config import CheckpointConfig, CheckpointEvent  # noqa: F401
# Re-exported: callers read keys and values through the manager module.
from layout_core.checkpoint.shard_io import checkpoint_keys, checkpoint_values
from layout_core.checkpoint.damage import (CheckpointDamage, aside_path, describe, is_damage,
                                           saved_variables)
from layout_core.checkpoint.frozen_base import (BASE_FILE, BaseReference, CheckpointView,
                                                reference_for)
from layout_core.checkpoint.files import (DATA_STATE_FILE, DirectoryWatch, checkpoint_dirs,
                                          directory_size, latest_valid,
                                          read_data_state, resolve_checkpoint_path, validate,
                                          write_manifest)
from layout_core.checkpoint.matching import check_fits, entries_by_name
from layout_core.checkpoint.state_file import StateFile
from layout_core.layout.cluster import SingleClient
from layout_core.durable import sync_directory
from layout_core.errors import ConfigError
from layout_core.lazy import tf

_SHARED_CHECK = '.shared-filesystem-check'
_WRITE_ATTEMPTS = 3  # a single client's tries at a save whose directory keeps vanishing


class _RemovedWhileWriting(Exception):
  """Something removed the temporary directory of a save, or files in it, before its commit."""


def merge_data_states(texts) -> dict | None:
  """One data state from every client's (JSON text, '' for none): each
  client reports the streams it reads; together they cover all of them."""
  merged: dict = {}
  for text in texts:
    for split, streams in (json.loads(text) if text else {}).items():
      merged.setdefault(split, {}).update(streams)
  return merged or None


_escape = shard_io.escape


class Checkpointer:
  """Saves and restores `state` under `directory` (see module docstring)."""

  def __init__(self, *, directory: str, state: Mapping[str, tf.Module],
               config: CheckpointConfig, extra_files: Mapping[str, str] | None = None,
               on_event: Callable[[CheckpointEvent], None] | None = None,
               coordinator=None, check_state: Callable[[], None] | None = None,
               data_state: Callable[[], dict | None] | None = None):
    """`coordinator` (layout_core.layout.cluster) makes the clients of a multi-client
    run agree; only its client 0 renames, prunes and writes the manifest.
    `check_state()` runs before every save and raises to refuse it (the
    trainer's finiteness check: a diverged state is never committed).
    `data_state()` is where this client's input stands (JSON-able; merged
    over the clients into the checkpoint's data_state.json, and read back
    into `restored_data_state` on restore)."""
    self.directory = directory
    self.config = config
    self.state = dict(state)
    self.extra_files = dict(extra_files or {})
    self.on_event = on_event or (lambda event: None)
    self.coordinator = coordinator or SingleClient()
    self.check_state = check_state or (lambda: None)
    self.data_state = data_state or (lambda: None)
    self.restored_data_state: dict | None = None
    self.is_chief = self.coordinator.client_id == 0
    self.entries = shard_io.checkpoint_entries(self.state)
    self._object_graph = shard_io.object_graph(self.state) if self.is_chief else None
    self.base: BaseReference | None = None  # where the frozen weights are (frozen_base)
    self._last_save_time = time.monotonic()
    self._last_saved_step: int | None = None
    self._thread: threading.Thread | None = None
    self._thread_error: BaseException | None = None
    self._state_file = StateFile(directory=directory)

  def prepare_directory(self) -> None:
    """Creates the directory, removes what saves killed before their commit
    left (never valid), repairs a damaged state file and, with several
    clients, checks that all of them see it. The first write: called by
    `restore_latest`, after the run has been validated."""
    os.makedirs(self.directory, exist_ok=True)
    if self.is_chief:
      for name in os.listdir(self.directory):
        if name.startswith('tmp-'):
          shutil.rmtree(os.path.join(self.directory, name), ignore_errors=True)
      self._state_file.repair()
    if self.coordinator.num_clients > 1:
      self._check_shared_directory()

  def _check_shared_directory(self) -> None:
    """ConfigError naming every client that does not see client 0's directory."""
    path = os.path.join(self.directory, _SHARED_CHECK)
    token = random.randrange(1, 2**31) if self.is_chief else 0
    if self.is_chief:
      with open(path, 'w') as f:
        f.write(str(token))
    token = int(self.coordinator.gather(token)[0])
    try:
      with open(path) as f:
        sees = f.read().strip() == str(token)
    except OSError:
      sees = False
    blind = [c for c, flag in enumerate(self.coordinator.gather(0 if sees else 1)) if flag]
    if blind:
      self.coordinator.settle_before_leaving('shared-directory')  # every client says why
      raise ConfigError(
          f'client(s) {blind} cannot see the checkpoint directory {self.directory} that '
          'client 0 writes: every client writes its own shards into it',
          where='--model_dir', fix='put --model_dir on a filesystem that every host '
          'mounts at the same path (NFS, a cluster filesystem)')

  # -- restore -----------------------------------------------------------------------
  def check_latest_fits(self) -> int | None:
    """Read-only: the step of the checkpoint `restore_latest` would use (the
    newest undamaged one), after checking that it fits the model (ConfigError
    otherwise); None when there is none. Nothing on disk changes."""
    for step, path in checkpoint_dirs(self.directory):
      if validate(path) is None:
        try:
          self.check_compatible(os.path.join(path, 'ckpt'), step=step)
        except CheckpointDamage:  # an unreadable index: restore moves it aside
          continue
        return step
    return None

  def check_compatible(self, prefix: str, *, step: int | None = None) -> CheckpointView:
    """The checkpoint's tensors (with its base's: `frozen_base`) after a
    ConfigError listing every variable whose name or shape does not match (of
    those `restorable` reads from the checkpoint of `step`), or naming a
    base that is missing or changed."""
    view = CheckpointView(prefix, moved_to=self.config.moved_base)
    check_fits(prefix, self.restorable(prefix, step=step),
               roots=[_escape(name) + '/' for name in self.state], saved=view.shapes)
    return view

  def restorable(self, prefix: str, *, step: int | None) -> list:
    """The entries a restore reads from the checkpoint at `prefix`: every
    one; but from a step-0 checkpoint that holds no optimizer state at all
    (an import's: its weights alone, `layout_core.run.make_engine`'s
    `weights_only`), all but the optimizer's, whose fresh state is then the
    state it would have at step 0 anyway."""
    root = _escape('optimizer') + '/'
    if step != 0 or 'optimizer' not in self.state:
      return self.entries
    if any(key.startswith(root) for key in saved_variables(prefix)):
      return self.entries
    return [e for e in self.entries if not e.key.startswith(root)]

  def restore_latest(self) -> int | None:
    """Restores the newest undamaged checkpoint; returns its step or None.

    A damaged one (files missing, truncated or corrupt, a checksum or
    manifest that does not match; `damage.is_damage`) is reported by file and
    moved aside, and the previous one is tried. A checkpoint that does not fit
    the model is a ConfigError, and any other error while reading (a bug, out
    of memory, a device failure) propagates: neither moves anything. Every
    client tries the same candidates in the same order and they agree after
    each; only client 0 moves things, and only client 0 reads every file to
    check its checksum (they share the filesystem)."""
    self.prepare_directory()
    candidates = checkpoint_dirs(self.directory)
    self.coordinator.barrier()  # all have listed before client 0 moves anything
    for step, path in candidates:
      prefix = os.path.join(path, 'ckpt')
      start = time.perf_counter()
      problem, data_state, view = validate(path, check_contents=self.is_chief), None, None
      if problem is None:
        try:
          view = self.check_compatible(prefix, step=step)
          entries = self.restorable(prefix, step=step)
          view.read(entries)
          if len(entries) < len(self.entries):
            logging.info('%s holds the weights only (an import): the optimizer starts fresh',
                         prefix)
          data_state = read_data_state(path)
        except Exception as e:  # pylint: disable=broad-except  # all but damage re-raised
          if not is_damage(e):
            raise
          problem = f'reading {prefix} failed: {describe(e)}'
      failed = [c for c, flag in enumerate(self.coordinator.gather(problem is not None)) if flag]
      if not failed:
        self._hold(view.reference and dataclasses.replace(view.reference,
                                                          prefix=view.base_prefix))
        self._last_saved_step = step
        self.restored_data_state = data_state
        self.on_event(CheckpointEvent(step, prefix, 'resume',
                                      time.perf_counter() - start, directory_size(path)))
        logging.info('Resumed from %s at step %d', prefix, step)
        return step
      problem = problem or f'client(s) {failed} could not read it'
      aside = aside_path(path)
      logging.error('Checkpoint %s is unusable: %s. Moved it to %s and trying the '
                    'previous one.', path, problem, aside)
      if self.is_chief and os.path.exists(path):
        self._state_file.forget(os.path.basename(path))
        os.rename(path, aside)
        self._state_file.update()
    return None

  def init_from(self, source: str, variables: Mapping[str, tf.Variable], *,
                new: Collection[str] = (), frozen: Collection[str] = ()) -> int:
    """Reads `variables` (path -> variable) by name from another checkpoint.

    Works for object-graph checkpoints (meshgin's, keyed 'model/...') and
    name-based TF1 checkpoints (tf.compat.v1.train.Saver, keyed by variable
    name); `config.init_from_map` maps paths to names
    (`layout_core.checkpoint.matching`); the paths in `new` may be absent
    (they keep their initial values). The paths in `frozen` never change:
    this run's checkpoints hold those read here by reference to the
    checkpoint they came from (`frozen_base`). Returns the number of
    variables read.
    """
    prefix = resolve_checkpoint_path(source)
    start = time.perf_counter()
    view = CheckpointView(prefix, moved_to=self.config.moved_base)
    found, size_bytes = entries_by_name(prefix, variables, rename_rules=self.config.init_from_map,
                                        new=new, shapes=view.shapes)
    view.read(found)
    # Frozen weights held in another dtype here are named too: each read of
    # the base converts them again, to the same bits (`frozen_base`).
    self._hold(reference_for(view, found, self.entries,
                             frozen={id(variables[path]) for path in frozen}))
    self.on_event(CheckpointEvent(0, prefix, 'init_from', time.perf_counter() - start,
                                  size_bytes))
    logging.info('Initialised %d variables from %s', len(found), prefix)
    return len(found)

  def _hold(self, base: BaseReference | None) -> None:
    """Saves from now on leave out the variables `base` holds, and name it."""
    self.base = base
    if self.is_chief and base is not None:
      self._object_graph = shard_io.object_graph(self.state, omit=base.keys)

  def _saved_entries(self) -> list:
    if self.base is None:
      return self.entries
    return [e for e in self.entries if e.key not in self.base.keys]

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
    """Writes checkpoint `step` (async if configured); returns its final path.

    In a multi-client run every client must call this at the same step."""
    self.wait()
    if step == self._last_saved_step:  # set once a save of `step` is committed
      return None
    self.check_state()
    self._last_save_time = time.monotonic()
    final = os.path.join(self.directory, f'ckpt-{step}')
    if self.is_chief and os.path.exists(final):  # a broken one never moved aside
      os.rename(final, aside_path(final))
    temporary = os.path.join(self.directory, f'tmp-ckpt-{step}')
    start = time.perf_counter()
    writes = shard_io.snapshot(self._saved_entries(), client_id=self.coordinator.client_id,
                               object_graph_bytes=self._object_graph)
    data = self.data_state()
    writes = (writes, None if data is None else json.dumps(data, sort_keys=True))
    if self.config.async_save and self.coordinator.num_clients == 1:
      self._thread = threading.Thread(
          target=self._write_guarded, args=(writes, temporary, final, step, reason, start),
          name=f'checkpoint-{step}', daemon=False)
      self._thread.start()
    else:
      self._write(writes, temporary, final, step, reason, start)
    return os.path.join(final, 'ckpt')

  def save_written(self, step: int, *, reason: str, write: Callable[[str], int]) -> str:
    """Commits checkpoint `step` from the part bundles `write(directory)`
    writes there and counts (an import streaming its tensors to disk:
    `shard_io.write_tensor_part`; `state` may hold placeholders), as `save`
    commits its own. One client, one attempt: a stream is not read twice."""
    if self.coordinator.num_clients != 1:
      raise ValueError('save_written writes from one client')
    self.wait()
    final, temporary = (os.path.join(self.directory, f'{p}ckpt-{step}') for p in ('', 'tmp-'))
    shutil.rmtree(temporary, ignore_errors=True)
    os.makedirs(temporary)
    start, watch = time.perf_counter(), DirectoryWatch(temporary)
    try:
      self._commit(temporary, final, step, reason, start, expected_parts=write(temporary),
                   data_state=None, watch=watch)
    finally:
      watch.close()
    self._last_saved_step = step
    return os.path.join(final, 'ckpt')

  def wait(self) -> None:
    """Blocks until an async save in flight is on disk; re-raises its error."""
    if self._thread is not None:
      self._thread.join()
      self._thread = None
    if self._thread_error is not None:
      error, self._thread_error = self._thread_error, None
      raise error

  def _write_guarded(self, *args) -> None:
    try:
      self._write(*args)
    except BaseException as e:  # pylint: disable=broad-except  # surfaced by wait()
      self._thread_error = e

  def _write(self, writes, temporary: str, final: str, step: int, reason: str,
             start: float) -> None:
    """Writes and commits, then marks `step` saved. A single client whose
    directory is removed while it writes (a disk cleaner, an `rm -rf` of
    checkpoints/; TF may even recreate the directory for the shards still to
    come) writes the whole checkpoint again, from the same snapshot, into a
    fresh directory; several clients cannot redo a save alone and raise."""
    attempts = _WRITE_ATTEMPTS if self.coordinator.num_clients == 1 else 1
    for attempt in range(1, attempts + 1):
      if self.coordinator.num_clients == 1:  # nobody else writes here: start clean
        shutil.rmtree(temporary, ignore_errors=True)
      os.makedirs(temporary, exist_ok=True)
      watch = DirectoryWatch(temporary)
      try:
        self._write_once(writes, temporary, final, step, reason, start, watch=watch)
        break
      except (OSError, tf.errors.OpError, _RemovedWhileWriting) as e:
        # A file of this save gone missing under its writer (NotFound) is the
        # same removal, caught before the directory itself went.
        lost = isinstance(e, (_RemovedWhileWriting, FileNotFoundError, tf.errors.NotFoundError))
        if attempts == 1 or not (lost or watch.removed()):
          raise
        if attempt == attempts:
          raise RuntimeError(
              f'{temporary} was removed {attempts} times while checkpoint {step} was '
              f'being written ({describe(e)}); stop whatever deletes {self.directory} '
              'and run the same command again to resume from the last checkpoint '
              'on disk') from e
        logging.warning('%s was removed while checkpoint %d was being written (%s); '
                        'writing it again', temporary, step, describe(e))
      finally:
        watch.close()
    self._last_saved_step = step

  def _write_once(self, writes, temporary: str, final: str, step: int, reason: str,
                  start: float, *, watch: DirectoryWatch) -> None:
    client_id = self.coordinator.client_id
    writes, data_text = writes
    parts = shard_io.write_shards(writes, directory=temporary, client_id=client_id)
    written = self.coordinator.gather(len(parts))  # every client's parts are on disk
    data_texts = self.coordinator.gather_text(f'data-state-{step}', data_text or '')
    if self.is_chief:
      self._commit(temporary, final, step, reason, start, expected_parts=int(sum(written)),
                   data_state=merge_data_states(data_texts), watch=watch)
    self.coordinator.barrier()  # nobody returns before the checkpoint is committed

  def _commit(self, temporary: str, final: str, step: int, reason: str, start: float,
              *, expected_parts: int, data_state: dict | None, watch: DirectoryWatch) -> None:
    if watch.removed():  # its parts may be missing, with the count made up by new ones
      raise _RemovedWhileWriting(f'{temporary} was removed')
    parts = shard_io.find_parts(temporary)
    if len(parts) != expected_parts and self.coordinator.num_clients == 1:
      # Only this process wrote here: something deleted parts under it (an
      # `rm -rf` that lost the race for the directory itself, which the
      # writers kept filling, so it was left in place).
      raise _RemovedWhileWriting(f'{len(parts)} of the {expected_parts} shard bundles '
                                 f'written to {temporary} are left')
    if len(parts) != expected_parts:
      raise RuntimeError(
          f'{temporary} holds {len(parts)} shard bundles but the clients wrote '
          f'{expected_parts}: the clients do not share this filesystem')
    shard_io.merge_parts(parts, prefix=os.path.join(temporary, 'ckpt'))
    extra = dict(self.extra_files)
    if data_state is not None:
      extra[DATA_STATE_FILE] = json.dumps(data_state, indent=1, sort_keys=True)
    if self.base is not None:
      extra[BASE_FILE] = self.base.to_json(directory=final)
    for name, text in extra.items():
      with open(os.path.join(temporary, name), 'w') as f:
        f.write(text)
    write_manifest(temporary, step=step, reason=reason)
    if watch.removed():
      raise _RemovedWhileWriting(f'{temporary} was removed')
    os.rename(temporary, final)  # the commit point
    sync_directory(self.directory)
    event = CheckpointEvent(step, os.path.join(final, 'ckpt'), reason,
                            time.perf_counter() - start, directory_size(final))
    self._prune()
    self._state_file.update()
    logging.info('Saved checkpoint %s at step %d (%s, %.2f s)', event.path, step,
                 reason, event.seconds)
    self.on_event(event)

  def _prune(self) -> None:
    valid = [(s, p) for s, p in checkpoint_dirs(self.directory) if validate(p) is None]
    for _, path in valid[self.config.keep:]:
      self._state_file.forget(os.path.basename(path))
      shutil.rmtree(path, ignore_errors=True)
