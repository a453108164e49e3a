"""Frozen weights held by reference: a checkpoint that names its base instead of copying it.

    view = CheckpointView('runs/llama/checkpoints/ckpt-0/ckpt')  # its tensors (and its base's)
    found, _ = entries_by_name(view.prefix, variables, rename_rules=(), shapes=view.shapes)
    view.read(found)                                         # every device reads its slices
    reference = reference_for(view, found, run_entries, frozen=frozen_variable_ids)
    # ... the checkpointer saves all but reference.keys, plus base.json:
    write_text(f'{tmp}/{BASE_FILE}', reference.to_json(directory=final))
    CheckpointView(f'{run}/checkpoints/ckpt-300/ckpt').read(entries)  # both halves

A fine-tuning run started from `checkpoint.init_from` whose weights are
partly frozen (a LoRA base, or what `train.trainable` leaves out) never
changes those weights: they stay bit for bit the base's. So its checkpoints
hold only what it changes (the trainable variables, their optimizer state,
the counters, the data state) and `base.json`, which names the base: its
prefix (absolute, and relative to the checkpoint, so a tree of runs moved
together still finds it), the sha256 of its `.index` file, the base key of
every frozen variable and the shapes there. The index is small (kilobytes
for gigabytes of tensors) and already lists every tensor's name, dtype,
shape, offset and crc32c, so its digest identifies the base's contents
without reading them again; a byte changed in a data file later shows as
TensorFlow's own crc32c error when it is read, reported here as the base's.

Reading a run's checkpoint (resume, eval, decode, export, lm-eval, or another
run's `init_from`) goes through `CheckpointView`: the tensors it holds, and
those its base holds for it. A base that is missing, or whose index differs
(retrained in place, replaced), is a ConfigError naming the path and what
differs; `checkpoint.moved_base` says where a moved base is now (its index
must be the same). References are flat: a run started from a run that holds
its frozen weights by reference refers to the same base itself.

A frozen weight the run stores in another dtype (`train.frozen_dtype`: a
float32 base held in bfloat16 or int8) is named all the same: each read of
the base converts it again, to the same bits (`shard_io.read_entries`); an
int8 weight's scale is the run's own, and saved.

Frozen weights that come from no checkpoint (random-init layers frozen with
no `init_from`) are saved as before: only an unchanged copy of a checkpoint
can be named instead of written.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import math
import os
from typing import Collection, Iterable, Mapping, Sequence

from layout_core.checkpoint import shard_io
from layout_core.checkpoint.damage import CheckpointDamage, describe, is_damage, saved_variables
from layout_core.checkpoint.files import MANIFEST, resolve_checkpoint_path
from layout_core.errors import ConfigError
from layout_core.lazy import tf

BASE_FILE = 'base.json'
_FORMAT = 1


def fingerprint(prefix: str) -> str:
  """sha256 of the checkpoint's `.index` (every tensor's name, shape, dtype,
  place and crc32c): equal for the same checkpoint wherever it lies."""
  digest = hashlib.sha256()
  with open(prefix + '.index', 'rb') as f:
    while chunk := f.read(1 << 20):
      digest.update(chunk)
  return digest.hexdigest()


def manifest_step(prefix: str) -> int | None:
  """The step in meshgin's manifest beside `prefix`, None without one."""
  try:
    with open(os.path.join(os.path.dirname(prefix), MANIFEST)) as f:
      step = json.load(f).get('step')
  except (OSError, ValueError, AttributeError):
    return None
  return step if isinstance(step, int) else None


@dataclasses.dataclass(frozen=True)
class BaseReference:
  """Where a checkpoint's frozen weights are: another checkpoint's tensors."""
  prefix: str                             # the base's prefix, absolute
  index_sha256: str                       # `fingerprint` of the base when recorded
  keys: Mapping[str, str]                 # this checkpoint's key -> the base's key
  shapes: Mapping[str, Sequence[int]]     # the base's key -> its shape
  step: int | None = None                 # the base's step (its manifest's), for messages
  relative: str | None = None             # `prefix` relative to the recording checkpoint

  def to_json(self, *, directory: str) -> str:
    """base.json for the checkpoint directory `directory`."""
    return json.dumps({
        'format': _FORMAT, 'prefix': self.prefix,
        'relative': os.path.relpath(self.prefix, directory), 'index_sha256': self.index_sha256,
        'step': self.step, 'keys': dict(self.keys),
        'shapes': {k: list(v) for k, v in self.shapes.items()}}, indent=1, sort_keys=True)

  @property
  def num_bytes(self) -> int:
    """float32 bytes the reference stands for (for messages)."""
    return sum(4 * math.prod(shape) for shape in self.shapes.values())


def read_reference(directory: str) -> BaseReference | None:
  """The base.json of the checkpoint directory, None when it holds every
  tensor itself; CheckpointDamage when the file is unreadable."""
  path = os.path.join(directory, BASE_FILE)
  try:
    with open(path) as f:
      data = json.load(f)
    return BaseReference(prefix=data['prefix'], index_sha256=data['index_sha256'],
                         keys=dict(data['keys']), shapes=dict(data['shapes']),
                         step=data.get('step'), relative=data.get('relative'))
  except FileNotFoundError:
    return None
  except (ValueError, KeyError, TypeError) as e:
    raise CheckpointDamage(f'{path} is unreadable: {type(e).__name__}: {e}') from e


def _difference(reference: BaseReference, prefix: str) -> str:
  """What differs between the base as recorded and the checkpoint at `prefix`."""
  saved = saved_variables(prefix)
  missing = [k for k in reference.shapes if k not in saved]
  reshaped = [f'{k}: {list(saved[k])}, recorded {list(v)}' for k, v in reference.shapes.items()
              if k in saved and list(saved[k]) != list(v)]
  step = manifest_step(prefix)
  steps = (f'; it is step {step}, the run started from step {reference.step}'
           if step is not None and reference.step is not None and step != reference.step else '')
  if missing or reshaped:
    shown = (missing + reshaped)[:3]
    return (f'it has changed: {len(missing)} frozen tensor(s) missing and {len(reshaped)} of '
            f'other shapes ({"; ".join(shown)}){steps}')
  return (f'it has changed: the same tensor names and shapes, other contents (the sha256 of '
          f'{prefix}.index is {fingerprint(prefix)[:12]}..., the run recorded '
          f'{reference.index_sha256[:12]}...){steps}')


def locate(reference: BaseReference, *, recorded_in: str, moved_to: str | None = None) -> str:
  """The prefix of the base as it is on disk now: `moved_to` when given
  (a prefix, ckpt-N or run directory), else the recorded path, else the
  recorded path relative to `recorded_in` (the checkpoint directory).
  ConfigError naming each place looked at and what was wrong there."""
  if moved_to:
    candidates = [resolve_checkpoint_path(moved_to, where='checkpoint.moved_base')]
  else:
    candidates = [reference.prefix]
    if reference.relative:
      candidates.append(os.path.normpath(os.path.join(recorded_in, reference.relative)))
  problems = []
  for candidate in dict.fromkeys(os.path.abspath(c) for c in candidates):
    if not tf.io.gfile.exists(candidate + '.index'):
      problems.append(f'{candidate}: missing ({candidate}.index does not exist)')
    elif fingerprint(candidate) == reference.index_sha256:
      return candidate
    else:
      try:
        problems.append(f'{candidate}: {_difference(reference, candidate)}')
      except CheckpointDamage as e:  # the base's, never the reading checkpoint's damage
        problems.append(f'{candidate}: damaged ({e})')
  raise ConfigError(
      f'the checkpoint {recorded_in} holds its {len(reference.keys)} frozen weights '
      f'({reference.num_bytes / 2**20:.1f} MiB) by reference to the base checkpoint it '
      f'started from, {reference.prefix} (step {reference.step}; base.json there), which '
      f'cannot be used: {" | ".join(problems)}', where='checkpoint.moved_base',
      fix='put the base checkpoint back where it was; if it was moved, say where it is now '
          "with --gin_bindings=\"checkpoint.moved_base = '<its ckpt-N directory>'\" (it must "
          'be the same checkpoint). The adapters were trained on that very base: a changed '
          'one cannot stand in for it; start a new run from it with checkpoint.init_from '
          'instead. Nothing was changed on disk')


def read_base(prefix: str, entries: Iterable[shard_io.CheckpointEntry], *,
              saved_dtypes: Mapping[str, object] | None = None) -> None:
  """Reads entries (keyed as in the base) from the base at `prefix`; damage
  there is a ConfigError naming the base, never the reading checkpoint's."""
  with base_damage_named(prefix):
    shard_io.read_entries(prefix, entries, saved_dtypes=saved_dtypes)


@contextlib.contextmanager
def base_damage_named(prefix: str):
  """A block reading the base at `prefix`: damage found there is a
  ConfigError naming the base (other errors pass through)."""
  try:
    yield
  except Exception as e:  # pylint: disable=broad-except  # all but damage re-raised
    if not is_damage(e):
      raise
    raise ConfigError(f'reading the frozen weights from the base checkpoint {prefix} failed: '
                      f'{describe(e)}', where='checkpoint.moved_base',
                      fix='the base\'s files are damaged: restore them from a copy, or point '
                          'checkpoint.moved_base at an intact copy (the checkpoints that '
                          'refer to it were left as they are)') from None


class CheckpointView:
  """The tensors of the checkpoint at `prefix` by key: its own, and those
  its base holds for it (`reference`, found at `base_prefix`; module doc)."""

  def __init__(self, prefix: str, *, moved_to: str | None = None):
    self.prefix = prefix
    directory = os.path.dirname(prefix)
    self.reference = read_reference(directory)
    self.own = saved_variables(prefix)
    self.shapes: dict[str, list[int]] = dict(self.own)
    self.base_prefix = None
    if self.reference is not None:
      self.base_prefix = locate(self.reference, recorded_in=directory, moved_to=moved_to)
      for key, base_key in self.reference.keys.items():
        self.shapes.setdefault(key, list(self.reference.shapes[base_key]))
    self._readers: dict[str, object] = {}
    self._dtype_maps: dict[str, dict] = {}

  def source(self, key: str) -> tuple[str, str]:
    """(prefix, key) where the tensor `key` is stored."""
    if key in self.own or self.reference is None or key not in self.reference.keys:
      return self.prefix, key
    return self.base_prefix, self.reference.keys[key]

  def read(self, entries: Sequence[shard_io.CheckpointEntry]) -> None:
    """Assigns every entry's variable (`shard_io.read_entries`) from here or
    the base, converted from the dtype stored there."""
    own, based = [], []
    for entry in entries:
      prefix, key = self.source(entry.key)
      if prefix == self.prefix:
        own.append(entry)
      else:
        based.append(dataclasses.replace(entry, key=key))
    shard_io.read_entries(self.prefix, own, saved_dtypes=self._dtypes(self.prefix))
    if based:
      read_base(self.base_prefix, based, saved_dtypes=self._dtypes(self.base_prefix))

  def dtype(self, key: str):
    """The tf.DType the tensor `key` is stored in (here or in the base)."""
    prefix, stored = self.source(key)
    return self._dtypes(prefix)[stored]

  def _dtypes(self, prefix: str):
    if prefix not in self._dtype_maps:
      self._dtype_maps[prefix] = self._reader(prefix).get_variable_to_dtype_map()
    return self._dtype_maps[prefix]

  def get_tensor(self, key: str):
    """The whole tensor `key` as a numpy array, on the host (an export)."""
    prefix, stored = self.source(key)
    if prefix == self.prefix:
      return self._reader(prefix).get_tensor(stored)
    with base_damage_named(prefix):
      return self._reader(prefix).get_tensor(stored)

  def _reader(self, prefix: str):
    if prefix not in self._readers:
      self._readers[prefix] = tf.train.load_checkpoint(prefix)
    return self._readers[prefix]


def open_view(prefix: str, *, moved_to: str | None = None) -> CheckpointView:
  """`CheckpointView(prefix)` for a reader that only reads (an export): a
  damaged base.json is a ConfigError naming the checkpoint."""
  try:
    return CheckpointView(prefix, moved_to=moved_to)
  except CheckpointDamage as e:
    raise ConfigError(f'the checkpoint {prefix} is damaged: {e}', where='--checkpoint',
                      fix='export another checkpoint of the run (--checkpoint), or restore '
                          'this one from a copy') from None


def reference_for(view: CheckpointView, found: Sequence[shard_io.CheckpointEntry],
                  run_entries: Sequence[shard_io.CheckpointEntry], *,
                  frozen: Collection[int]) -> BaseReference | None:
  """The reference a run started from `view` records for its frozen
  variables (ids in `frozen`) that `found` (entries keyed as in `view`) read:
  those of the one checkpoint holding most of their bytes (the base; others,
  e.g. the layer norms a previous run trained, are saved by the run). None
  when no frozen variable was read. A stacked variable (several keys) is
  always saved."""
  whole = {id(e.variable): e.key for e in run_entries if e.index is None}
  stacked = {id(e.variable) for e in run_entries if e.index is not None}
  by_source: dict[str, dict[str, str]] = {}
  for entry in found:
    held = id(entry.variable)
    if held in frozen and held in whole and held not in stacked:
      prefix, key = view.source(entry.key)
      by_source.setdefault(prefix, {})[whole[held]] = key
  if not by_source:
    return None
  shapes_at = lambda prefix: view.own if prefix == view.prefix else view.reference.shapes  # noqa: E731
  size = lambda prefix: sum(math.prod(shapes_at(prefix)[k])  # noqa: E731
                            for k in by_source[prefix].values())
  prefix = max(by_source, key=size)
  keys = by_source[prefix]
  return BaseReference(prefix=os.path.abspath(prefix), index_sha256=fingerprint(prefix),
                       keys=keys, shapes={k: list(shapes_at(prefix)[k]) for k in keys.values()},
                       step=manifest_step(prefix))
