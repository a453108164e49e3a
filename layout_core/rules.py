"""Layout rules: ordered regexes on variable paths -> per-dimension sharding.

    rules = LayoutRules([
        (r'.*/ffn/w_in', ('unsharded', 'model')),
        (r'.*/ffn/w_out', ('model', 'unsharded')),
    ])
    rules.match('lm/stack/block_003/ffn/w_in')      # -> 0 (rule index)
    rules.resolve('lm/stack/block_003/ffn/w_in', shape=(64, 256),
                  mesh_axes={'data': 2, 'model': 4})
    # -> Resolution(spec=('unsharded', 'model'), rule_index=0)

Semantics: a rule whose pattern equals the path exactly wins first; otherwise
the first rule (declared order) whose pattern `re.fullmatch`es the path; no
match means fully replicated. Every spec entry is a mesh axis name or
'unsharded'.

Matching is fast for large models: paths usually differ only in layer numbers,
and most rules cannot tell one digit from another (they contain no digits,
`\\d`, `\\w` or character ranges). For those "digit-blind" rules the answer for
`block_017/ffn` is the answer for `block_000/ffn`, so it is computed once per
path *shape* and cached. Digit-sensitive rules are tried with one combined
alternation regex, whose first matching branch is the first matching rule.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Iterable, Mapping, Sequence

from layout_core.errors import ConfigError

UNSHARDED = 'unsharded'
_DIGITS_TO_ZERO = str.maketrans('123456789', '000000000')
# Escapes that stand for a character class or a back-reference; any of these
# (or a literal digit) may distinguish one digit from another.
_DIGIT_SENSITIVE = re.compile(r'[0-9]|\\[A-Za-z0-9]')
_UNCOMBINABLE = re.compile(r'\\[1-9]|\(\?P=|\(\?\(|\(\?P<|\(\?[aiLmsux]+\)')
_CHAR_CLASS = re.compile(r'\[(\^?)((?:\\.|[^\]])*)\]')


@dataclasses.dataclass(frozen=True)
class Rule:
  pattern: str
  spec: tuple[str, ...]
  index: int

  def describe(self) -> str:
    return f'rule {self.index} ({self.pattern!r} -> {self.spec})'


@dataclasses.dataclass(frozen=True)
class Resolution:
  spec: tuple[str, ...]
  rule_index: int | None  # None: no rule matched, fully replicated

  def source(self, rules: 'LayoutRules') -> str:
    if self.rule_index is None:
      return 'default: replicated'
    return f'{self.rule_index}: {rules.rules[self.rule_index].pattern}'


def _digit_blind(pattern: str) -> bool:
  """True if no part of `pattern` can tell one digit character from another."""
  for match in _CHAR_CLASS.finditer(pattern):
    body = match.group(2)
    if '-' in body.strip('-') or _DIGIT_SENSITIVE.search(body):
      return False
  without_classes = _CHAR_CLASS.sub('', pattern)
  return not _DIGIT_SENSITIVE.search(without_classes)


class _FirstMatch:
  """First matching rule among a subset, as one regex where possible."""

  def __init__(self, rules: Sequence[tuple[int, re.Pattern]]):
    self._loop: list[tuple[int, re.Pattern]] = []
    combinable = []
    for index, compiled in rules:
      if _UNCOMBINABLE.search(compiled.pattern):
        self._loop.append((index, compiled))
      else:
        combinable.append((index, compiled))
    self._combined = None
    if combinable:
      source = '|'.join(f'(?P<r{i}>(?:{c.pattern}))' for i, c in combinable)
      try:
        self._combined = re.compile(source)
      except re.error:
        self._loop.extend(combinable)
        self._loop.sort()

  def __call__(self, text: str) -> int | None:
    best = None
    if self._combined is not None:
      match = self._combined.fullmatch(text)
      if match:
        best = int(match.lastgroup[1:])
    for index, compiled in self._loop:
      if best is not None and index > best:
        break
      if compiled.fullmatch(text):
        best = index
        break
    return best


class LayoutRules:
  """An ordered, validated list of (regex, sharding spec) rules."""

  def __init__(self, rules: Iterable[tuple[str, Sequence[str]]] | Mapping[str, Sequence[str]] = (),
               *, strict: bool = False):
    items = list(rules.items()) if isinstance(rules, Mapping) else list(rules)
    self.strict = strict
    self.rules: list[Rule] = []
    compiled: list[tuple[int, re.Pattern]] = []
    for index, item in enumerate(items):
      if not (isinstance(item, (tuple, list)) and len(item) == 2):
        raise ConfigError(f'layout rule {index} is {item!r}',
                          where='layout_rules.rules',
                          fix="write each rule as (r'regex', ('axis_or_unsharded', ...))")
      pattern, spec = item
      if isinstance(spec, str):
        spec = (spec,)
      spec = tuple(spec)
      rule = Rule(pattern=pattern, spec=spec, index=index)
      try:
        compiled.append((index, re.compile(pattern)))
      except re.error as e:
        raise ConfigError(f'{rule.describe()} is not a valid regex: {e}',
                          where='layout_rules.rules',
                          fix='escape special characters or fix the pattern') from None
      if not all(isinstance(s, str) for s in spec):
        raise ConfigError(f'{rule.describe()} has a non-string spec entry',
                          fix="use mesh axis names or 'unsharded'")
      self.rules.append(rule)
    self._exact = {}
    for rule in self.rules:
      self._exact.setdefault(rule.pattern, rule.index)
    self._blind = _FirstMatch([c for c in compiled if _digit_blind(c[1].pattern)])
    sensitive = [c for c in compiled if not _digit_blind(c[1].pattern)]
    self._sensitive = _FirstMatch(sensitive) if sensitive else None
    self._blind_cache: dict[str, int | None] = {}
    self.match_counts = [0] * len(self.rules)

  def __len__(self) -> int:
    return len(self.rules)

  def match(self, path: str) -> int | None:
    """Index of the rule that decides `path` (exact key, then first regex)."""
    exact = self._exact.get(path)
    if exact is not None:
      return exact
    key = path.translate(_DIGITS_TO_ZERO)
    try:
      best = self._blind_cache[key]
    except KeyError:
      best = self._blind_cache[key] = self._blind(key)
    if self._sensitive is not None:
      other = self._sensitive(path)
      if other is not None and (best is None or other < best):
        best = other
    return best

  def match_many(self, paths: Iterable[str]) -> list[int | None]:
    return [self.match(p) for p in paths]

  def check_mesh(self, mesh_axes: Mapping[str, int]) -> None:
    """Rejects rules naming unknown axes or using one axis twice."""
    for rule in self.rules:
      used = [a for a in rule.spec if a != UNSHARDED]
      for axis in used:
        if axis not in mesh_axes:
          raise ConfigError(
              f"{rule.describe()} names mesh axis '{axis}', but the mesh has "
              f"axes {list(mesh_axes)}", where='layout_rules.rules',
              fix=f"use one of {list(mesh_axes)} or '{UNSHARDED}'")
      duplicates = sorted({a for a in used if used.count(a) > 1})
      if duplicates:
        raise ConfigError(
            f"{rule.describe()} shards over axis '{duplicates[0]}' twice",
            where='layout_rules.rules',
            fix='a mesh axis may shard at most one dimension of a tensor')

  def resolve(self, path: str, shape: Sequence[int],
              mesh_axes: Mapping[str, int]) -> Resolution:
    """The validated sharding spec for one variable, counting the match."""
    index = self.match(path)
    if index is None:
      return Resolution(spec=(UNSHARDED,) * len(shape), rule_index=None)
    self.match_counts[index] += 1
    rule = self.rules[index]
    spec = rule.spec
    if len(spec) != len(shape):
      raise ConfigError(
          f"variable '{path}' has rank {len(shape)} (shape {tuple(shape)}) "
          f'but {rule.describe()} has {len(spec)} entries',
          where='layout_rules.rules',
          fix=f'give exactly {len(shape)} entries or narrow the regex')
    for dim, (size, axis) in enumerate(zip(shape, spec)):
      if axis == UNSHARDED:
        continue
      if axis not in mesh_axes:
        raise ConfigError(
            f"{rule.describe()} names mesh axis '{axis}' for variable '{path}', "
            f'but the mesh has axes {list(mesh_axes)}',
            where='layout_rules.rules', fix=f"use one of {list(mesh_axes)}")
      if size % mesh_axes[axis]:
        raise ConfigError(
            f"variable '{path}' dim {dim} has size {size}, not divisible by "
            f"mesh axis '{axis}' of size {mesh_axes[axis]} ({rule.describe()})",
            where='layout_rules.rules',
            fix=f"shard dim {dim} over an axis dividing {size}, or leave it '{UNSHARDED}'")
    return Resolution(spec=spec, rule_index=index)

  def unused_rules(self) -> list[Rule]:
    return [r for r, n in zip(self.rules, self.match_counts) if n == 0]

  def reset_counts(self) -> None:
    self.match_counts = [0] * len(self.rules)


def naive_first_match(compiled: Sequence[re.Pattern], path: str) -> int | None:
  """Reference semantics (one fullmatch per rule, in order); used by tests/bench."""
  for index, pattern in enumerate(compiled):
    if pattern.pattern == path:
      return index
  for index, pattern in enumerate(compiled):
    if pattern.fullmatch(path):
      return index
  return None
