"""What a sweep is: axes of gin bindings, expanded into a named trial list.

An axis is one gin binding with several values; a trial is one value per axis.

    axes = [parse_axis('optimizer.learning_rate=[3e-3, 1e-3]'),
            parse_axis('pipeline.num_micro_batches=[1, 2]')]
    trials = expand(axes, mode='product')
    trials[0].name       # 'learning_rate=0.003,num_micro_batches=1'
    trials[0].bindings   # ['optimizer.learning_rate = 3e-3', 'pipeline.num_micro_batches = 1']

Values are gin expressions kept as written (`[1e-3, 'relu', {'data': 4}]`, even
`@ref()`), so a trial's binding is exactly what the user typed. Modes:

* `product` (default): every combination of the list axes;
* `zip`: the i-th value of every axis (lists of equal length);
* `random`: `num_trials` draws with `seed`, from lists (uniformly) and ranges:
  `uniform(lo, hi)`, `log_uniform(lo, hi)` for reals, `int_range(lo, hi)` for
  integers (both ends included).

A sweep file holds the sweep's flags, one per line, without the leading `--`
(see `read_sweep_file`), so a sweep can be reviewed and re-run.

Nothing here imports TensorFlow or gin: a sweep is checked in milliseconds.
"""

from __future__ import annotations

import ast
import dataclasses
import hashlib
import itertools
import math
import random
import re
from typing import Any, Sequence

from layout_core.errors import ConfigError

MODES = ('product', 'zip', 'random')
RANGE_KINDS = ('uniform', 'log_uniform', 'int_range')
_KEY = re.compile(r'[A-Za-z_][\w./]*\.[A-Za-z_]\w*')
_AXIS = re.compile(r'^\s*([^=\s]+)\s*=\s*(.+?)\s*$', re.DOTALL)
_RANGE = re.compile(r'^(\w+)\s*\((.*)\)$', re.DOTALL)
_MAX_NAME = 120  # characters of a trial directory name before it is shortened


@dataclasses.dataclass(frozen=True)
class Axis:
  """One swept binding: `values` (gin texts) for a list, or a `kind` range."""
  key: str                          # gin binding key, e.g. 'optimizer.learning_rate'
  values: tuple[str, ...] = ()      # list axis: each value's gin text, as written
  kind: str = 'list'                # 'list' or one of RANGE_KINDS
  low: float = 0.0                  # range axis: lower end (included)
  high: float = 0.0                 # range axis: upper end (included)

  @property
  def short_name(self) -> str:
    """The parameter name alone: 'learning_rate' for 'optimizer.learning_rate'."""
    return self.key.rsplit('.', 1)[-1]

  def describe(self) -> str:
    if self.kind == 'list':
      return f'{self.key}=[{", ".join(self.values)}]'
    return f'{self.key}={self.kind}({self.low:g}, {self.high:g})'

  def to_json(self) -> dict[str, Any]:
    if self.kind == 'list':
      return {'key': self.key, 'kind': 'list', 'values': list(self.values)}
    return {'key': self.key, 'kind': self.kind, 'low': self.low, 'high': self.high}


@dataclasses.dataclass(frozen=True)
class Trial:
  """One run of the sweep: a value (gin text) per axis key, and its directory name."""
  name: str                         # directory under the sweep root and TensorBoard run
  values: dict[str, str]            # axis key -> gin text of the value

  @property
  def bindings(self) -> list[str]:
    return [f'{key} = {text}' for key, text in self.values.items()]

  def to_json(self) -> dict[str, Any]:
    return {'name': self.name, 'values': dict(self.values), 'bindings': self.bindings}


def literal(text: str) -> Any:
  """The Python value of a gin text when it is a plain literal, else the text."""
  try:
    return ast.literal_eval(text)
  except (ValueError, SyntaxError):
    return text


def split_top_level(text: str) -> list[str]:
  """Splits `a, [b, c], 'd,e'` at commas outside brackets and quotes."""
  parts, depth, quote, start = [], 0, '', 0
  for i, char in enumerate(text):
    if quote:
      if char == quote and text[i - 1] != '\\':
        quote = ''
    elif char in '\'"':
      quote = char
    elif char in '([{':
      depth += 1
    elif char in ')]}':
      depth -= 1
    elif char == ',' and depth == 0:
      parts.append(text[start:i].strip())
      start = i + 1
  parts.append(text[start:].strip())
  return [p for p in parts if p]


def parse_axis(spec: str) -> Axis:
  """`key=[v1, v2]` or `key=uniform(lo, hi)` (also log_uniform, int_range)."""
  where = f"--sweep='{spec}'"
  match = _AXIS.match(spec)
  if not match or not _KEY.fullmatch(match.group(1)):
    raise ConfigError(f'cannot read the sweep axis {spec!r}', where=where,
                      fix="write 'configurable.parameter=[value, value, ...]', e.g. "
                          "'optimizer.learning_rate=[1e-3, 3e-4]'")
  key, body = match.groups()
  if body.startswith('[') and body.endswith(']'):
    values = tuple(split_top_level(body[1:-1]))
    if not values:
      raise ConfigError(f'the sweep axis {key} has no values', where=where,
                        fix='list at least one value')
    return Axis(key=key, values=values)
  range_match = _RANGE.match(body)
  if range_match and range_match.group(1) in RANGE_KINDS:
    kind, arguments = range_match.group(1), split_top_level(range_match.group(2))
    numbers = [literal(a) for a in arguments]
    if len(numbers) != 2 or not all(isinstance(n, (int, float)) for n in numbers):
      raise ConfigError(f'{kind} needs two numbers, got ({range_match.group(2)})',
                        where=where, fix=f'write {kind}(low, high)')
    low, high = numbers
    if not low < high:
      raise ConfigError(f'{kind}({low}, {high}) is empty: low must be below high',
                        where=where, fix='swap or widen the ends')
    if kind == 'log_uniform' and low <= 0:
      raise ConfigError(f'log_uniform needs positive ends, got {low}', where=where,
                        fix='use a positive lower end, or uniform(...)')
    if kind == 'int_range' and not all(isinstance(n, int) for n in numbers):
      raise ConfigError(f'int_range needs integer ends, got ({low}, {high})',
                        where=where, fix='use uniform(...) for real values')
    return Axis(key=key, kind=kind, low=low, high=high)
  raise ConfigError(f'the sweep values {body!r} are neither a list nor a range',
                    where=where, fix='write [v1, v2, ...], uniform(lo, hi), '
                                     'log_uniform(lo, hi) or int_range(lo, hi)')


def _name_part(text: str) -> str:
  """A value's gin text as a file-name-safe fragment: {'data': 2} -> data2."""
  value = literal(text)
  if isinstance(value, float):
    text = f'{value:.4g}'
  text = re.sub(r"[\s'\"{}\[\]()@%]", '', text).replace(':', '').replace(',', '_')
  return re.sub(r'[^\w.=+-]', '_', text) or '_'


def trial_name(values: dict[str, str], axes: Sequence[Axis]) -> str:
  """`param=value,param=value`, the short parameter names unless two axes share one."""
  short = [a.short_name for a in axes]
  parts = []
  for axis in axes:
    label = axis.short_name if short.count(axis.short_name) == 1 else axis.key
    parts.append(f'{_name_part(label)}={_name_part(values[axis.key])}')
  name = ','.join(parts)
  if len(name) > _MAX_NAME:  # keep it readable and under file-system limits
    digest = hashlib.sha1(name.encode()).hexdigest()[:8]
    name = f'{name[:_MAX_NAME - 9]}~{digest}'
  return name


def _sample(axis: Axis, rng: random.Random) -> str:
  if axis.kind == 'list':
    return rng.choice(axis.values)
  if axis.kind == 'int_range':
    return str(rng.randint(int(axis.low), int(axis.high)))
  if axis.kind == 'uniform':
    return repr(rng.uniform(axis.low, axis.high))
  return repr(math.exp(rng.uniform(math.log(axis.low), math.log(axis.high))))


def expand(axes: Sequence[Axis], *, mode: str = 'product', num_trials: int = 0,
           seed: int = 0) -> list[Trial]:
  """The trial list, in a fixed order (the same inputs give the same trials)."""
  if not axes:
    raise ConfigError('the sweep has no axes', where='--sweep / --sweep_file',
                      fix="add --sweep='configurable.parameter=[v1, v2]'")
  keys = [a.key for a in axes]
  repeated = sorted({k for k in keys if keys.count(k) > 1})
  if repeated:
    raise ConfigError(f'the sweep names {", ".join(repeated)} more than once',
                      where='--sweep', fix='give each binding one axis')
  if mode not in MODES:
    raise ConfigError(f'unknown sweep mode {mode!r}', where='--sweep_mode',
                      fix=f'use one of {", ".join(MODES)}')
  ranges = [a.key for a in axes if a.kind != 'list']
  if ranges and mode != 'random':
    raise ConfigError(f'{", ".join(ranges)} is a range, which only random search can '
                      f'draw from (mode is {mode!r})', where='--sweep_mode',
                      fix='set --sweep_mode=random --num_trials=N, or list the values')
  if mode == 'random':
    if num_trials < 1:
      raise ConfigError(f'random search needs --num_trials >= 1, got {num_trials}',
                        where='--num_trials', fix='set --num_trials=N')
    rng = random.Random(seed)
    rows = [tuple(_sample(a, rng) for a in axes) for _ in range(num_trials)]
  elif mode == 'zip':
    lengths = {a.key: len(a.values) for a in axes}
    if len(set(lengths.values())) > 1:
      raise ConfigError('zip needs lists of one length, got ' + ', '.join(
          f'{k}: {n}' for k, n in lengths.items()), where='--sweep_mode=zip',
          fix='give every axis the same number of values, or use product')
    rows = list(zip(*(a.values for a in axes)))
  else:
    rows = list(itertools.product(*(a.values for a in axes)))
  if num_trials and mode != 'random':
    rows = rows[:num_trials]
  trials, used = [], set()
  for row in rows:
    values = dict(zip(keys, row))
    name = base = trial_name(values, axes)
    copy = 1
    while name in used:  # random draws (or zip rows) can repeat a combination
      copy += 1
      name = f'{base}~{copy}'
    used.add(name)
    trials.append(Trial(name=name, values=values))
  return trials


@dataclasses.dataclass
class SweepFile:
  """The flags a sweep file sets (lists extend, scalars override the defaults)."""
  gin_file: list[str] = dataclasses.field(default_factory=list)
  gin_bindings: list[str] = dataclasses.field(default_factory=list)
  sweep: list[str] = dataclasses.field(default_factory=list)
  settings: dict[str, str] = dataclasses.field(default_factory=dict)  # sweep_mode, ...

  slurm_sbatch_arg: list[str] = dataclasses.field(default_factory=list)

  LIST_FIELDS = ('gin_file', 'gin_bindings', 'sweep', 'slurm_sbatch_arg')
  SETTING_FIELDS = ('sweep_mode', 'num_trials', 'seed', 'parallel', 'trial_timeout',
                    'launcher', 'slurm_partition', 'slurm_tasks', 'slurm_cpus_per_task',
                    'slurm_on_stop')


def read_sweep_file(path: str) -> SweepFile:
  """Reads `field = value` lines named like the flags; `#` starts a comment line.

      # configs/sweeps/quickstart_lr.sweep
      gin_file = configs/experiments/quickstart.gin
      gin_bindings = train.num_steps = 100
      sweep = optimizer.learning_rate = [3e-3, 1e-3, 3e-4]
      sweep_mode = product
  """
  try:
    with open(path) as f:
      lines = f.read().splitlines()
  except OSError as e:
    raise ConfigError(f'cannot read the sweep file {path!r}: {e.strerror}',
                      where='--sweep_file', fix='check the path') from e
  result = SweepFile()
  for number, line in enumerate(lines, 1):
    if not line.strip() or line.lstrip().startswith('#'):
      continue
    field, _, value = line.partition('=')
    field, value = field.strip(), value.strip()
    if field in SweepFile.LIST_FIELDS and value:
      if field == 'sweep':  # 'key = [..]' and 'key=[..]' are the same axis
        key, _, rest = value.partition('=')
        value = f'{key.strip()}={rest.strip()}'
      getattr(result, field).append(value)
    elif field in SweepFile.SETTING_FIELDS and value:
      result.settings[field] = value
    else:
      known = ', '.join(SweepFile.LIST_FIELDS + SweepFile.SETTING_FIELDS)
      raise ConfigError(f'cannot read {line.strip()!r}', where=f'{path}, line {number}',
                        fix=f'write "field = value" with a field among {known}')
  return result
