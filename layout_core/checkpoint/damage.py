"""What counts as a damaged checkpoint, and what happens to one.

    try:
      shard_io.read_entries(prefix, entries)
    except Exception as e:
      if not is_damage(e):
        raise                  # a bug, out of memory, a dead peer: nothing moves
      os.rename(directory, aside_path(directory))  # kept, never deleted

Damage is something wrong with the files: missing, truncated, or other bytes
than were written. It shows as TensorFlow's NotFoundError, DataLossError or
OutOfRangeError (measured on TF 2.21: a removed, a flipped-byte and a
truncated or overwritten data file), as an index TF's checkpoint reader cannot
parse (`saved_variables`), or as our own finding (`CheckpointDamage`: a
checksum or size that does not match the manifest, a data state that is not
JSON). Anything else is not damage and must propagate: a ValueError or
InvalidArgumentError from our own code is a bug, and treating it as damage
would move every good checkpoint aside and restart the run from step 0.
"""

from __future__ import annotations

import time

from layout_core.lazy import tf


class CheckpointDamage(Exception):
  """A checkpoint's files are missing, truncated or corrupt (the message says which)."""


def _damage_codes() -> tuple[int, ...]:
  return (tf.errors.NOT_FOUND, tf.errors.DATA_LOSS, tf.errors.OUT_OF_RANGE)


def is_damage(error: BaseException) -> bool:
  """True if reading a checkpoint failed because of its files; False for
  everything else: a runtime error (out of memory, a device or peer failure),
  a checkpoint that does not fit the model (ConfigError), a bug."""
  if isinstance(error, CheckpointDamage):
    return True
  return isinstance(error, tf.errors.OpError) and error.error_code in _damage_codes()


def saved_variables(prefix: str) -> dict[str, list[int]]:
  """Key -> shape of every tensor in the checkpoint at `prefix`.

  CheckpointDamage when its index is missing or cannot be parsed: TF's
  checkpoint reader reports an unparseable file ('not an sstable', 'Unable to
  read file') as a bare OpError with code UNKNOWN, which only a file it read
  can cause."""
  try:
    return dict(tf.train.list_variables(prefix))
  except tf.errors.OpError as e:
    unparseable = type(e) is tf.errors.OpError and e.error_code == tf.errors.UNKNOWN
    if not (unparseable or is_damage(e)):
      raise
    first_line = str(e).splitlines()[0] if str(e) else ''
    raise CheckpointDamage(f'{prefix}.index cannot be read: {type(e).__name__}: '
                           f'{first_line}') from e


def describe(error: BaseException) -> str:
  """One line for the log: the error's type and the first line of its message."""
  text = str(error)
  return f'{type(error).__name__}: {text.splitlines()[0] if text else ""}'


def aside_path(path: str) -> str:
  """Where a damaged checkpoint (or state file) at `path` is moved, kept for
  inspection and never deleted: `<path>.corrupt-<time>`."""
  return f'{path}.corrupt-{int(time.time())}'
