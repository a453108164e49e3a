"""The machine rates the cost model divides by, measured once and cached.

    rates = load_rates(device_type='CPU')          # bench/calibrate.py's file, or nominal
    rates.matmul_rate('float32', flops_per_call=1e8), rates.transfer('all_reduce', 4, 2**20)
    rates.stale_reason()                            # None when measured on this machine

`python bench/calibrate.py` measures them on this machine's virtual CPU mesh
(matmul and elementwise rates per device with every device busy, the time of
one collective of each kind (all-reduce, all-gather, all-to-all) per
mesh-axis size and message size, and the fixed costs of a real training
step's structure: per block run and device per engine, per routed block,
per tensor-parallel all-reduce, per FSDP and ZeRO-1 variable) and writes
`bench/results/calibration.json`; `load_rates` reads it (or the file its
caller names: `launch.inspect --calibration`). Rates for another device type, or with no file, are
nominal figures, and `stale_reason` says so, as it does for a file measured
on another machine, TensorFlow version or more than 90 days ago. Plain Python.
"""

from __future__ import annotations

import bisect
import dataclasses
import datetime
import json
import math
import os
import platform
from typing import Mapping, Sequence

from layout_core.errors import ConfigError

STALE_DAYS = 90
_RESULTS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))), 'bench', 'results')
_REPO_FILE = os.path.join(_RESULTS, 'calibration.json')
MARGINS_FILE = os.path.join(_RESULTS, 'suggest.json')
# Where bench/suggest.py measured no margin (no results file: an installed
# wheel), the worst it measured over every family, rounded up.
DEFAULT_MARGIN = 1.0


@dataclasses.dataclass(frozen=True)
class Collective:
  """Time of one collective over an axis of `size` devices:
  latency + bytes per device / bandwidth."""
  latency_s: float
  bytes_per_s: float


@dataclasses.dataclass(frozen=True)
class Rates:
  """Per-device rates with every device of the mesh busy at once."""
  device_type: str
  # dtype -> [(FLOPs per matmul call, FLOP/s)], ascending: rates grow with size.
  matmul: Mapping[str, Sequence[tuple[float, float]]]
  elementwise: Mapping[str, float]          # dtype -> element-ops/s per device
  # kind ('all_reduce' | 'all_gather' | 'all_to_all') -> {axis size: Collective},
  # within one host (a kind not measured: all_reduce's).
  collectives: Mapping[str, Mapping[int, Collective]]
  cross_host: Collective                     # any collective across hosts, per byte
  # Fixed costs of a training step, measured on tiny models (bench/calibrate.py):
  # one Transformer block run, per device its program spans, by engine
  # ('plain', 'submesh', 'spmd'; a pipeline's shifts included)
  block_device_s: Mapping[str, float]
  step_s: float           # the step itself: input, embedding, loss, dispatch
  tensor_s: Mapping[int, float]  # one tensor-parallel all-reduce, by model axis size
  spmd_tick_s: float      # one tick of the SPMD pipeline engine (its shift, its masks)
  fsdp_variable_s: float  # one FSDP-split variable's gather and reduction
  zero_variable_s: float  # one variable's ZeRO-1 update and gather
  devices_share_cores: bool  # CPU: the devices of a process share its cores
  # dtype -> the share of `matmul`'s rate a training step gets (1: all)
  matmul_efficiency: Mapping[str, float] = dataclasses.field(default_factory=dict)
  # 'data' | 'fsdp' | 'zero1' -> the scale of that collective's bytes term in a
  # real step (1: as the micro-benchmarks say)
  collective_scale: Mapping[str, float] = dataclasses.field(default_factory=dict)
  # the share of the sub-mesh engine's bubble that shows where devices share cores
  shared_bubble: float = 0.0
  # one variable's own gradient sum per tick, with the SPMD engine's circular
  # repeats (cost.py's 'SPMD per-tick sums'); None: the all-reduce's latency
  spmd_sum_variable_s: float | None = None
  # one routed block run per device its program spans, beyond a dense
  # block's (routing, dispatch and combine's small ops); 0: not measured
  moe_block_s: float = 0.0
  # the share of `matmul`'s rate a routed layer's batched einsums (its
  # experts', dispatch and combine) get, relative to a dense layer's
  moe_matmul_share: float = 1.0
  source: str = 'nominal'    # where the figures come from
  measured: dict = dataclasses.field(default_factory=dict)  # provenance

  def matmul_rate(self, dtype: str, flops_per_call: float) -> float:
    """FLOP/s of one matmul of this size (interpolated in log size)."""
    table = self.matmul.get(dtype) or self.matmul['float32']
    share = self.matmul_efficiency.get(dtype, 1.0)
    sizes = [s for s, _ in table]
    i = bisect.bisect_left(sizes, flops_per_call)
    if i == 0:
      return share * table[0][1]
    if i == len(table):
      return share * table[-1][1]
    (s0, r0), (s1, r1) = table[i - 1], table[i]
    w = (math.log(flops_per_call) - math.log(s0)) / (math.log(s1) - math.log(s0))
    return share * (r0 + w * (r1 - r0))

  def elementwise_rate(self, dtype: str) -> float:
    return self.elementwise.get(dtype) or self.elementwise['float32']

  def transfer(self, kind: str, size: int, nbytes: float, *, cross_host: bool = False
               ) -> float:
    """Seconds a collective's bytes take over `size` devices, `nbytes` per
    device (no latency: the fixed costs count it)."""
    if size <= 1 or nbytes <= 0:
      return 0.0
    if cross_host:
      return nbytes / self.cross_host.bytes_per_s
    table = self.collectives.get(kind) or self.collectives['all_reduce']
    return nbytes / _at_or_below(table, size).bytes_per_s

  def latency(self, kind: str, size: int) -> float:
    """Seconds one collective of `kind` over `size` devices takes before its
    bytes (its calibrated latency)."""
    if size <= 1:
      return 0.0
    table = self.collectives.get(kind) or self.collectives['all_reduce']
    return _at_or_below(table, size).latency_s

  def tensor_latency(self, size: int) -> float:
    """Fixed cost of one tensor-parallel all-reduce over `size` devices in a
    step."""
    return _at_or_below(self.tensor_s, size) if self.tensor_s else 0.0

  def stale_reason(self) -> str | None:
    """Why these rates may not describe this machine (None: they do)."""
    if self.source == 'nominal':
      return (f'nominal {self.device_type} figures, not measured here: run '
              'python bench/calibrate.py')
    here = machine_facts()
    for key in ('processor', 'cores', 'tensorflow', 'isa'):
      if self.measured.get(key) != here.get(key) and here.get(key) is not None:
        if key not in self.measured:
          return (f'the calibration does not record its machine\'s {key} (this machine\'s: '
                  f'{here[key]!r}): rerun python bench/calibrate.py')
        return (f'measured with {key} {self.measured.get(key)!r}, this machine has '
                f'{here.get(key)!r}: rerun python bench/calibrate.py')
    date = self.measured.get('date', '')
    try:
      age = datetime.datetime.now(datetime.timezone.utc) - datetime.datetime.fromisoformat(date)
    except ValueError:
      return 'the calibration has no date: rerun python bench/calibrate.py'
    if age.days > STALE_DAYS:
      return f'measured {age.days} days ago: rerun python bench/calibrate.py'
    return None

  def describe(self) -> str:
    reason = self.stale_reason()
    where = (f'{self.source}, measured {self.measured.get("date", "?")[:10]}'
             if self.source != 'nominal' else 'nominal')
    return where + (f' (STALE: {reason})' if reason else '')


def _at_or_below(table: Mapping[int, object], size: int):
  """The entry of the largest measured axis size at or below `size` (the
  smallest measured, below them all)."""
  sizes = sorted(table)
  return table[([s for s in sizes if s <= size] or sizes[:1])[-1]]


def machine_facts() -> dict:
  """What a calibration depends on: processor, cores, TensorFlow version
  (read from the installed package's metadata, without importing it), and
  the processor's vector extensions that decide its matmul kernels (`isa`):
  two CPUs both named 'AMD EPYC' ran bfloat16 steps two orders of magnitude
  apart, one with AVX-512 and one with AVX2 alone."""
  from importlib import metadata  # pylint: disable=import-outside-toplevel
  try:
    version = metadata.version('tensorflow')
  except metadata.PackageNotFoundError:
    version = None
  cores = len(os.sched_getaffinity(0)) if hasattr(os, 'sched_getaffinity') else os.cpu_count()
  return {'processor': processor_name() or platform.machine(), 'cores': cores,
          'tensorflow': version, 'isa': vector_extensions()}


# The /proc/cpuinfo flags that change which matmul kernels run (float32 and bfloat16).
_ISA_FLAGS = ('avx2', 'fma', 'avx512f', 'avx512_vnni', 'avx512_bf16', 'amx_tile', 'amx_bf16')


def vector_extensions() -> str | None:
  """The processor's matmul-relevant flags, e.g. 'avx2 fma' (None where
  /proc/cpuinfo cannot be read)."""
  try:
    with open('/proc/cpuinfo') as f:
      for line in f:
        if line.startswith('flags'):
          flags = set(line.split(':', 1)[1].split())
          return ' '.join(flag for flag in _ISA_FLAGS if flag in flags)
  except OSError:
    pass
  return None


def processor_name() -> str:
  """The CPU model (/proc/cpuinfo's 'model name'), or '' where unknown."""
  try:
    with open('/proc/cpuinfo') as f:
      for line in f:
        if line.startswith('model name'):
          return line.split(':', 1)[1].strip()
  except OSError:
    pass
  return ''


# Nominal figures where nothing was measured: an accelerator of the H100 class
# (dense bf16 at ~40% of peak; NVLink within a host, 400 Gb/s across hosts) and
# a 2-core CPU. Only their ratios matter for a ranking; `stale_reason` flags them.
NOMINAL = {
    'GPU': dict(matmul={'float32': [(1e6, 5e12), (1e9, 2.5e13)],
                        'bfloat16': [(1e6, 1e13), (1e9, 4e14)]},
                elementwise={'float32': 2e11, 'bfloat16': 4e11},
                collectives={'all_reduce': {2: Collective(2e-5, 1.5e11)},
                             'all_gather': {2: Collective(1e-5, 3e11)}},
                cross_host=Collective(5e-5, 4e10),
                block_device_s={'plain': 1e-5, 'submesh': 1e-5, 'spmd': 1e-5}, step_s=1e-3,
                spmd_tick_s=1e-4,
                tensor_s={2: 2e-5}, fsdp_variable_s=2e-5,
                zero_variable_s=1e-5, devices_share_cores=False),
    'CPU': dict(matmul={'float32': [(1e6, 2e9), (1e9, 8e9)],
                        'bfloat16': [(1e6, 1e9), (1e9, 3e9)]},
                elementwise={'float32': 3e8, 'bfloat16': 2e8},
                collectives={'all_reduce': {2: Collective(2e-4, 2e9)},
                             'all_gather': {2: Collective(1e-4, 4e9)}},
                cross_host=Collective(1e-3, 1e9),
                block_device_s={'plain': 5e-4, 'submesh': 5e-4, 'spmd': 4e-4}, step_s=1e-2,
                spmd_tick_s=5e-3,
                tensor_s={2: 1e-3}, fsdp_variable_s=1e-4,
                zero_variable_s=1e-4, devices_share_cores=True),
}
NOMINAL['TPU'] = NOMINAL['GPU']


def load_rates(*, device_type: str, path: str | None = None) -> Rates:
  """The measured rates for `device_type` (see the module docstring): from
  `path`, else from the checkout's bench/results/calibration.json where
  there is one (an installed wheel has none: nominal rates). A `path` that
  is missing or not a calibration file is a ConfigError naming it."""
  if path is None:
    data = _read_calibration(_REPO_FILE) if os.path.exists(_REPO_FILE) else None
    source = os.path.relpath(_REPO_FILE)
  else:
    data, source = _read_calibration(path), path
  if data is None or data.get('device_type') != device_type:
    return Rates(device_type=device_type, **NOMINAL[device_type])
  try:
    return rates_from_json(data, source=source)
  except (KeyError, TypeError, ValueError, AttributeError) as e:
    raise _not_a_calibration(source, f'{type(e).__name__}: {e}') from None


def _read_calibration(path: str) -> dict:
  """The JSON object in `path` (ConfigError naming the file where it is
  missing or not a JSON object)."""
  try:
    with open(path) as f:
      data = json.load(f)
  except FileNotFoundError:
    raise _not_a_calibration(path, 'no such file') from None
  except (OSError, ValueError) as e:
    raise _not_a_calibration(path, str(e)) from None
  if not isinstance(data, dict):
    raise _not_a_calibration(path, f'a JSON {type(data).__name__}, not an object')
  return data


def _not_a_calibration(path: str, why: str) -> ConfigError:
  return ConfigError(f'the calibration file {path!r} cannot be read: {why}',
                     where='--calibration', fix='give a file python bench/calibrate.py '
                                                '--out=FILE wrote, or leave --calibration out')


def rates_from_json(data: dict, *, source: str) -> Rates:
  collectives = {kind: {int(size): Collective(**fit) for size, fit in by_size.items()}
                 for kind, by_size in data['collectives'].items()}
  return Rates(device_type=data['device_type'],
               matmul={dtype: [tuple(p) for p in table] for dtype, table in data['matmul'].items()},
               elementwise=data['elementwise'], collectives=collectives,
               cross_host=Collective(**data['cross_host']),
               block_device_s=data['block_device_s'], step_s=data['step_s'],
               spmd_tick_s=data.get('spmd_tick_s', 0.0),
               tensor_s={int(k): v for k, v in data['tensor_s'].items()},
               fsdp_variable_s=data['fsdp_variable_s'], zero_variable_s=data['zero_variable_s'],
               devices_share_cores=data['devices_share_cores'],
               matmul_efficiency=data.get('matmul_efficiency', {}),
               collective_scale=data.get('collective_scale', {}),
               shared_bubble=data.get('shared_bubble', 0.0),
               spmd_sum_variable_s=data.get('spmd_sum_variable_s'),
               moe_block_s=data.get('moe_block_s', 0.0),
               moe_matmul_share=data.get('moe_matmul_share', 1.0), source=source,
               measured=data.get('measured', {}))


def load_margins(path: str | None = None) -> tuple[dict[str, float], float]:
  """({layout family: margin}, the margin for a family not measured): the
  memory estimate's worst measured error per family (measured peak /
  estimate - 1, over every candidate bench/suggest.py trained; never below
  0), from its results file."""
  path = path or MARGINS_FILE
  if not os.path.exists(path):
    return {}, DEFAULT_MARGIN
  with open(path) as f:
    margins = json.load(f).get('memory_margins') or {}
  return dict(margins), max(margins.values(), default=DEFAULT_MARGIN)
