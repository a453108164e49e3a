"""A sweep in TensorBoard's HParams dashboard, and the metrics read back from it.

    write_experiment(root, axes)                     # once, in the sweep root
    write_session_start(trial_dir, trial, axes, trial_id='1: 3e-3')  # before it runs
    write_session_end(trial_dir, status='SUCCESS', wall_seconds=42.0)
    final_metrics(trial_dir)   # {'eval/loss': 1.02, 'train/tokens_per_sec': ...}

The sweep root's run ('.') holds the experiment config: one HParam per swept
binding, named by its gin key, with its domain (Discrete for a list,
RealInterval / IntInterval for a range), and the METRICS below. Each trial's
directory is one run, i.e. one session: `launch.train` writes its scalars there
and the sweep driver adds a small event file (suffix `.sweep`) with the session
start (swept values, and a trial id short enough for the dashboard's Trial ID
column: `trial_id`) and, when the trial exits,
`usage/sweep_wall_seconds` and the session end (SUCCESS or FAILURE). The driver, not
the trial, writes them because only the driver sees crashes and timeouts.

Written with TensorBoard's own protos and event-file writer (no TensorFlow ops).
"""

from __future__ import annotations

import glob
import os
import re
import time
from typing import Sequence

from plugins.sweep.spec import Axis, Trial, literal

WALL_SECONDS_TAG = 'usage/sweep_wall_seconds'
METRICS = (  # (tag, display name): each trial's last value is what the dashboard shows
    ('eval/loss', 'eval loss (final)'),
    ('train/tokens_per_sec', 'tokens/s (last window)'),
    ('usage/param_bytes_per_device_max', 'parameter bytes / device'),
    (WALL_SECONDS_TAG, 'wall seconds'),
)
SWEEP_EVENTS_SUFFIX = '.sweep'  # the driver's event files in a trial directory


def _typed_values(axis: Axis) -> list:
  """A list axis's values as one HParams type: bool, number or string."""
  values = [literal(text) for text in axis.values]
  if all(isinstance(v, bool) for v in values):
    return values
  if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
    return [float(v) for v in values]
  if all(isinstance(v, str) for v in values):
    return values
  return list(axis.values)  # dicts, tuples, @references: the gin text itself


def hparam_value(axis: Axis, text: str):
  """The value of `text` (a gin text of `axis`) in the axis's HParams type."""
  if axis.kind != 'list':
    return int(literal(text)) if axis.kind == 'int_range' else float(literal(text))
  typed = _typed_values(axis)
  return typed[list(axis.values).index(text)] if text in axis.values else text


def _hparam(axis: Axis):
  from tensorboard.plugins.hparams import api as hp  # pylint: disable=g-import-not-at-top
  if axis.kind == 'list':
    domain = hp.Discrete(sorted(set(_typed_values(axis))))
  elif axis.kind == 'int_range':
    domain = hp.IntInterval(int(axis.low), int(axis.high))
  else:
    domain = hp.RealInterval(float(axis.low), float(axis.high))
  return hp.HParam(axis.key, domain, display_name=axis.key,
                   description=f'swept: {axis.describe()}')


def _write(logdir: str, summaries: Sequence, *, step: int = 0) -> str:
  """Writes summaries as one new, closed event file in `logdir`; returns its path."""
  # pylint: disable=g-import-not-at-top
  from tensorboard.compat.proto import event_pb2, summary_pb2
  from tensorboard.summary.writer.event_file_writer import EventFileWriter
  os.makedirs(logdir, exist_ok=True)
  writer = EventFileWriter(logdir, filename_suffix=SWEEP_EVENTS_SUFFIX)
  for summary in summaries:
    # Some TensorBoard helpers build the proto with TensorFlow's classes.
    proto = summary_pb2.Summary.FromString(summary.SerializeToString())
    writer.add_event(event_pb2.Event(wall_time=time.time(), step=step, summary=proto))
  writer.close()
  return writer._file_name  # pylint: disable=protected-access


def write_experiment(root: str, axes: Sequence[Axis]) -> str:
  """The experiment config (HParams with domains, metrics) in the sweep root."""
  from tensorboard.plugins.hparams import api as hp  # pylint: disable=g-import-not-at-top
  for old in glob.glob(os.path.join(root, '*' + SWEEP_EVENTS_SUFFIX)):
    os.remove(old)  # one experiment config per root, the current one
  metrics = [hp.Metric(tag, display_name=name) for tag, name in METRICS]
  return _write(root, [hp.hparams_config_pb(hparams=[_hparam(a) for a in axes],
                                            metrics=metrics)])


def clear_sessions(trial_dir: str) -> None:
  """Removes an earlier attempt's session records (a retried trial starts anew)."""
  for old in glob.glob(os.path.join(trial_dir, '*' + SWEEP_EVENTS_SUFFIX)):
    os.remove(old)


def trial_id(trial: Trial, *, number: int, count: int) -> str:
  """The HParams trial id: the trial's number (1-based, zero-padded to sort),
  then its swept values as written, without spaces and quotes (`03: 3e-4 64`).
  The dashboard's Trial ID column shows about 16 characters, so the trial's
  name (`learning_rate=0.0003,...`, its run and directory) would show only
  its first key there."""
  values = ' '.join(re.sub(r'[\s\'"]', '', text) for text in trial.values.values())
  return f'{number:0{len(str(count))}d}: {values}'


def write_session_start(trial_dir: str, trial: Trial, axes: Sequence[Axis], *,
                        trial_id: str) -> str:
  from tensorboard.plugins.hparams import api as hp  # pylint: disable=g-import-not-at-top
  hparams = {a.key: hparam_value(a, trial.values[a.key]) for a in axes}
  return _write(trial_dir, [hp.hparams_pb(hparams, trial_id=trial_id)])


def write_session_end(trial_dir: str, *, status: str, wall_seconds: float,
                      step: int = 0) -> str:
  """`status` is 'SUCCESS' or 'FAILURE'; wall time goes in as a scalar metric."""
  # pylint: disable=g-import-not-at-top
  from tensorboard.plugins.hparams import api_pb2, summary as hparams_summary
  from tensorboard.plugins.scalar import summary_v2 as scalar_summary
  return _write(trial_dir, [
      scalar_summary.scalar_pb(WALL_SECONDS_TAG, wall_seconds),
      hparams_summary.session_end_pb(api_pb2.Status.Value(f'STATUS_{status}')),
  ], step=step)


def final_metrics(trial_dir: str) -> dict[str, float]:
  """The last value of each METRICS tag in the trial's event files, read back
  with TensorBoard's event-file reader (the trial's own files and the driver's)."""
  # pylint: disable=g-import-not-at-top
  from tensorboard.backend.event_processing import event_file_loader
  from tensorboard.util import tensor_util
  metric_tags = {tag for tag, _ in METRICS}
  latest: dict[str, tuple[float, int, float]] = {}  # tag -> (wall time, step, value)
  for path in sorted(glob.glob(os.path.join(trial_dir, 'events.out.tfevents.*'))):
    for event in event_file_loader.EventFileLoader(path).Load():
      for value in event.summary.value:
        if value.tag in metric_tags and value.HasField('tensor'):
          number = float(tensor_util.make_ndarray(value.tensor))
          key = (event.wall_time, event.step)
          if value.tag not in latest or key >= latest[value.tag][:2]:
            latest[value.tag] = (event.wall_time, event.step, number)
  return {tag: entry[2] for tag, entry in latest.items()}
