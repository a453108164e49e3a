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
match means fully replicated. Every spec entry is a mesh axis name,
'unsharded', or an optional axis 'name?': split over that axis where its
size divides the dimension, else left whole (grouped-query attention's few
key/value heads: `configs/layouts/megatron.gin`), which the resolution says
in its `source` (layouts.txt, `launch.inspect`). A rule that decides no variable although its pattern fits some
is *shadowed*: earlier rules took every one of them (`rule_uses`).

Matching is fast for large models and rule sets, with the same answers as
trying every rule in order (tested and benchmarked against that):
  * most rules cannot tell one digit from another (no digits, `\\d`, `\\w` or
    character ranges); for them the answer for `block_017/ffn` is the answer
    for `block_000/ffn`, so it is computed once per path shape and cached;
  * a rule is only tried on paths containing the literal text it requires
    (found with Python's own regex parser), located through a word index.
"""

from __future__ import annotations

import dataclasses
import re
try:
  from re import _constants as _sre_constants, _parser as _sre_parser  # Python >= 3.11
except ImportError:  # Python 3.10
  import sre_constants as _sre_constants  # pylint: disable=deprecated-module
  import sre_parse as _sre_parser  # pylint: disable=deprecated-module
from typing import Iterable, Mapping, Sequence

from layout_core.errors import ConfigError

UNSHARDED = 'unsharded'
OPTIONAL = '?'  # 'model?': split over 'model' where it divides the dimension


def axis_name(entry: str) -> str:
  """The mesh axis (or 'unsharded') a spec entry names: 'model?' -> 'model'."""
  return entry[:-1] if entry.endswith(OPTIONAL) else entry
_DIGITS_TO_ZERO = str.maketrans('123456789', '000000000')
# Escapes that stand for a character class or a back-reference; any of these
# (or a literal digit) may distinguish one digit from another.
_DIGIT_SENSITIVE = re.compile(r'[0-9]|\\[A-Za-z0-9]')
_LITERAL = _sre_constants.LITERAL
_WORD = re.compile(r'[A-Za-z0-9_]+')
_CHAR_CLASS = re.compile(r'\[(\^?)((?:\\.|[^\]])*)\]')


@dataclasses.dataclass(frozen=True)
class Rule:
  pattern: str
  spec: tuple[str, ...]
  index: int

  def describe(self) -> str:
    return f'rule {self.index} ({self.pattern!r} -> {self.spec})'


@dataclasses.dataclass(frozen=True)
class RuleUse:
  """What one rule did to a model's variables (`LayoutRules.rule_uses`)."""
  rule: Rule
  matched: int                    # variables this rule decided
  fits: int                       # variables its pattern fits (counted for unused rules)
  shadowed_by: tuple[int, ...]    # the rules that decided those variables instead

  @property
  def unused(self) -> bool:
    return self.matched == 0

  @property
  def shadowed(self) -> bool:
    """Fits some variables, decides none: first match wins, and others came first."""
    return self.matched == 0 and self.fits > 0

  def describe(self) -> str:
    if not self.unused:
      return f'{self.matched} variable(s)'
    if not self.shadowed:
      return 'matched nothing'
    return (f'shadowed: the {self.fits} variable(s) it fits were taken by '
            + ', '.join(f'rule {i}' for i in self.shadowed_by))


@dataclasses.dataclass(frozen=True)
class Resolution:
  spec: tuple[str, ...]
  rule_index: int | None  # None: no rule matched, fully replicated
  left_whole: tuple[str, ...] = ()  # optional axes that did not divide their dimension
  followed: tuple[str, 'Resolution'] | None = None  # (path, its resolution) taken as is

  def source(self, rules: 'LayoutRules') -> str:
    if self.followed is not None:
      path, resolution = self.followed
      return f'as {path}: {resolution.source(rules)}'
    if self.rule_index is None:
      return 'default: replicated'
    note = f' ({"; ".join(self.left_whole)})' if self.left_whole else ''
    return f'{self.rule_index}: {rules.rules[self.rule_index].pattern}{note}'


def _digit_blind(pattern: str) -> bool:
  """True if no part of `pattern` can tell one digit character from another."""
  for match in _CHAR_CLASS.finditer(pattern):
    body = match.group(2)
    if '-' in body.strip('-') or _DIGIT_SENSITIVE.search(body):
      return False
  without_classes = _CHAR_CLASS.sub('', pattern)
  return not _DIGIT_SENSITIVE.search(without_classes)


def _required_literals(compiled: re.Pattern) -> list[tuple[str, bool, bool]]:
  """Literal runs every match must contain: [(text, at_pattern_start, at_end)].

  Only top-level literal characters count (nothing inside groups, classes or
  repeats), so each run is a necessary substring of any match.
  """
  if compiled.flags & re.IGNORECASE:
    return []
  try:
    items = list(_sre_parser.parse(compiled.pattern))
  except Exception:  # pylint: disable=broad-except
    return []
  runs, current, start = [], [], 0
  for position, (op, argument) in enumerate(items):
    if op is _LITERAL:
      if not current:
        start = position
      current.append(chr(argument))
      continue
    if current:
      runs.append((''.join(current), start == 0, False))
      current = []
  if current:
    runs.append((''.join(current), start == 0, True))
  return runs


def _bounded_word(runs: list[tuple[str, bool, bool]]) -> str | None:
  """The longest word that must appear in a match as a whole path token."""
  best = None
  for text, at_start, at_end in runs:
    for word in _WORD.finditer(text):
      left = word.start() > 0 or at_start
      right = word.end() < len(text) or at_end
      if left and right and (best is None or len(word.group()) > len(best)):
        best = word.group()
  return best


class _FirstMatch:
  """First matching rule among a subset, trying only plausible candidates.

  Each rule is filed under one whole word its matches must contain (e.g.
  'w_in' for '.*/ffn/w_in'); a path only tries the rules filed under its own
  words plus the rules that could not be filed, in declared order, and each
  try is skipped unless the rule's longest required literal is in the path.
  """

  def __init__(self, rules: Sequence[tuple[int, re.Pattern]]):
    self._by_index = {}
    self._by_word: dict[str, list[int]] = {}
    self._unfiled: list[int] = []
    for index, compiled in rules:
      runs = _required_literals(compiled)
      literal = max((text for text, _, _ in runs), key=len, default='')
      self._by_index[index] = (literal, compiled.fullmatch)
      word = _bounded_word(runs)
      if word is None:
        self._unfiled.append(index)
      else:
        self._by_word.setdefault(word, []).append(index)

  def __call__(self, text: str, below: int | None = None) -> int | None:
    candidates = list(self._unfiled)
    for word in set(_WORD.findall(text)):
      filed = self._by_word.get(word)
      if filed:
        candidates += filed
    candidates.sort()
    by_index = self._by_index
    for index in candidates:
      if below is not None and index >= below:
        return None
      literal, fullmatch = by_index[index]
      if literal in text and fullmatch(text):
        return index
    return None


class LayoutRules:
  """An ordered, validated list of (regex, sharding spec) rules.

  Args:
    rules: Ordered (regex, spec) pairs, or a {regex: spec} dict; a spec has one
      entry per tensor dimension, a mesh axis name or 'unsharded' (a lone string
      is a one-entry spec). A pattern equal to a variable's path wins, else the
      first regex that fullmatches it; a variable no rule matches is replicated.
    strict: True makes a rule that decides no variable (matched nothing, or
      shadowed by earlier rules) a configuration error; False logs a warning.
  """

  def __init__(self, rules: Iterable[tuple[str, Sequence[str]]] | Mapping[str, Sequence[str]] = (),
               *, strict: bool = False):
    if isinstance(rules, str) or not isinstance(rules, (Mapping, list, tuple)):
      raise ConfigError(f'layout_rules.rules = {rules!r} is not a list of rules',
                        where='layout_rules.rules',
                        fix="write [(r'regex', ('axis_or_unsharded', ...)), ...]")
    if not isinstance(strict, bool):
      raise ConfigError(f'layout_rules.strict = {strict!r} is not True or False',
                        where='layout_rules.strict', fix='use True or False')
    items = list(rules.items()) if isinstance(rules, Mapping) else list(rules)
    self.strict = strict
    self.rules: list[Rule] = []
    compiled: list[tuple[int, re.Pattern]] = []
    self._compiled = compiled
    for index, item in enumerate(items):
      if not (isinstance(item, (tuple, list)) and len(item) == 2):
        raise ConfigError(f'layout rule {index} is {item!r}',
                          where='layout_rules.rules',
                          fix="write each rule as (r'regex', ('axis_or_unsharded', ...))")
      pattern, spec = item
      if isinstance(spec, str):
        spec = (spec,)
      if not isinstance(pattern, str):
        raise ConfigError(f'layout rule {index} has pattern {pattern!r}, not a string',
                          where='layout_rules.rules',
                          fix="write the pattern as a string, e.g. r'.*/ffn/w_in'")
      if not isinstance(spec, (tuple, list)) or not all(isinstance(s, str) for s in spec):
        raise ConfigError(
            f'layout rule {index} ({pattern!r}) has spec {spec!r}, not a tuple of mesh '
            "axis names or 'unsharded'", where='layout_rules.rules',
            fix="write one entry per tensor dimension, e.g. ('unsharded', 'model')")
      spec = tuple(spec)
      rule = Rule(pattern=pattern, spec=spec, index=index)
      try:
        compiled.append((index, re.compile(pattern)))
      except re.error as e:
        raise ConfigError(f'{rule.describe()} is not a valid regex: {e}',
                          where='layout_rules.rules',
                          fix='escape special characters or fix the pattern') from None
      self.rules.append(rule)
    self._exact = {}
    for rule in self.rules:
      self._exact.setdefault(rule.pattern, rule.index)
    self._blind = _FirstMatch([c for c in compiled if _digit_blind(c[1].pattern)])
    sensitive = [c for c in compiled if not _digit_blind(c[1].pattern)]
    self._sensitive = _FirstMatch(sensitive) if sensitive else None
    self._blind_cache: dict[str, int | None] = {}

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
      other = self._sensitive(path, below=best)
      if other is not None:
        best = other
    return best

  def match_many(self, paths: Iterable[str]) -> list[int | None]:
    return [self.match(p) for p in paths]

  def check_mesh(self, mesh_axes: Mapping[str, int]) -> None:
    """Rejects rules naming unknown axes or using one axis twice."""
    for rule in self.rules:
      used = [axis_name(a) for a in rule.spec if axis_name(a) != UNSHARDED]
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
              mesh_axes: Mapping[str, int], *, follows=None) -> Resolution:
    """The validated sharding spec for one variable. With `follows` (a
    `layout_core.layout.variables.Follows`) and no rule matching `path`,
    the followed variable's spec on the dimensions it names."""
    index = self.match(path)
    if index is None and follows is not None:
      base = self.resolve(follows.path, follows.shape, mesh_axes)
      spec = tuple(UNSHARDED if d is None else base.spec[d] for d in follows.dims)
      return Resolution(spec=spec, rule_index=None, followed=(follows.path, base))
    if index is None:
      return Resolution(spec=(UNSHARDED,) * len(shape), rule_index=None)
    rule = self.rules[index]
    spec = rule.spec
    if len(spec) != len(shape):
      raise ConfigError(
          f"variable '{path}' has rank {len(shape)} (shape {tuple(shape)}) "
          f'but {rule.describe()} has {len(spec)} entries',
          where='layout_rules.rules',
          fix=f'give exactly {len(shape)} entries or narrow the regex')
    resolved, left_whole = [], []
    for dim, (size, entry) in enumerate(zip(shape, spec)):
      axis = axis_name(entry)
      resolved.append(axis)
      if axis == UNSHARDED:
        continue
      if axis not in mesh_axes:
        raise ConfigError(
            f"{rule.describe()} names mesh axis '{axis}' for variable '{path}', "
            f'but the mesh has axes {list(mesh_axes)}',
            where='layout_rules.rules', fix=f"use one of {list(mesh_axes)}")
      if size % mesh_axes[axis] and entry.endswith(OPTIONAL):
        resolved[-1] = UNSHARDED
        left_whole.append(f"dim {dim} ({size}) whole: '{axis}' ({mesh_axes[axis]}) "
                          'does not divide it')
        continue
      if size % mesh_axes[axis]:
        raise ConfigError(
            f"variable '{path}' dim {dim} has size {size}, not divisible by "
            f"mesh axis '{axis}' of size {mesh_axes[axis]} ({rule.describe()})",
            where='layout_rules.rules',
            fix=f"shard dim {dim} over an axis dividing {size}, leave it '{UNSHARDED}', "
                f"or write '{axis}{OPTIONAL}' to split it only where '{axis}' divides it")
    return Resolution(spec=tuple(resolved), rule_index=index, left_whole=tuple(left_whole))

  def match_counts(self, rule_indices: Iterable[int | None]) -> list[int]:
    """How many of the given resolutions (rule index or None) each rule decided."""
    counts = [0] * len(self.rules)
    for index in rule_indices:
      if index is not None:
        counts[index] += 1
    return counts

  def unused_rules(self, rule_indices: Iterable[int | None]) -> list[Rule]:
    """The rules that decided none of the given resolutions."""
    return [r for r, n in zip(self.rules, self.match_counts(rule_indices)) if n == 0]

  def rule_uses(self, paths: Sequence[str],
                rule_indices: Sequence[int | None]) -> list[RuleUse]:
    """Per rule, in order: how many variables it decided (`rule_indices[i]`
    decided `paths[i]`) and, for a rule that decided none, which rules took the
    variables its pattern fits. Only unused rules are tried against the paths,
    so this stays cheap for large rule sets."""
    uses = []
    for rule, count in zip(self.rules, self.match_counts(rule_indices)):
      takers: set[int] = set()
      fits = 0
      if count == 0:
        fullmatch = self._compiled[rule.index][1].fullmatch
        for path, index in zip(paths, rule_indices):
          if path == rule.pattern or fullmatch(path):
            fits += 1
            takers.add(index)
      uses.append(RuleUse(rule=rule, matched=count, fits=fits,
                          shadowed_by=tuple(sorted(i for i in takers if i is not None))))
    return uses


def naive_first_match(compiled: Sequence[re.Pattern], path: str) -> int | None:
  """Reference semantics (one fullmatch per rule, in order); used by tests/bench."""
  for index, pattern in enumerate(compiled):
    if pattern.pattern == path:
      return index
  for index, pattern in enumerate(compiled):
    if pattern.fullmatch(path):
      return index
  return None
