"""What a running step costs: peak memory and model FLOPs per second.

    scalars = usage_scalars(mesh=mesh, steps_per_sec=2.0, model_flops_per_step=1e12,
                            peak_flops=8 * 1e11)
    # {'usage/host_peak_bytes': ..., 'train/model_flops_per_sec': 2e12, 'train/mfu': 2.5}

The training loop writes these at its logging steps (docs/tensorboard.md, "Tags").
"""

from __future__ import annotations

import resource
import sys

from layout_core.lazy import tf


def host_peak_bytes() -> int:
  """This process's peak resident set size (getrusage; KiB on Linux, bytes on macOS)."""
  peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
  return int(peak) if sys.platform == 'darwin' else int(peak) * 1024


def device_peak_bytes(mesh) -> int | None:
  """The largest peak allocation of this process's accelerators on `mesh`, where
  TensorFlow reports one (GPU); None on CPU (the host figure covers it)."""
  device_type = mesh.device_type() if mesh is not None else 'CPU'
  if device_type == 'CPU':
    return None
  peaks = []
  for device in mesh.local_devices():
    name = device.rsplit('/device:', 1)[-1]
    try:
      peaks.append(int(tf.config.experimental.get_memory_info(name)['peak']))
    except (ValueError, RuntimeError):  # not reported for this device type
      return None
  return max(peaks, default=None)


def usage_scalars(*, mesh, steps_per_sec: float, model_flops_per_step: float | None,
                  peak_flops: float | None) -> dict[str, float]:
  """The peak-memory (usage/*) and FLOP-rate scalars of a logging step; `peak_flops` is the
  whole mesh's (mesh.peak_flops_per_device x devices), None when not declared."""
  values: dict[str, float] = {'usage/host_peak_bytes': host_peak_bytes()}
  device = device_peak_bytes(mesh)
  if device is not None:
    values['usage/device_peak_bytes'] = device
  if model_flops_per_step:
    rate = model_flops_per_step * steps_per_sec
    values['train/model_flops_per_sec'] = rate
    if peak_flops:
      values['train/mfu'] = rate / peak_flops
  return values
