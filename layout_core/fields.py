"""Type and range checks for config dataclasses, naming the gin parameter.

A config dataclass calls these from `__post_init__`, so a wrong value fails
where it is made, with the parameter's name, the value, and what it must be:

    @dataclasses.dataclass(frozen=True)
    class TrainConfig:
      num_steps: int = 300
      def __post_init__(self):
        check_types(self, name='train')
        at_least(self, 'train', num_steps=1)

    TrainConfig(num_steps=10.5)
    # ConfigError: train.num_steps = 10.5 is a float, but it must be an int.

Types come from the annotations: int (bool is not an int here), float (an
int is accepted), bool, str, `X | None`, `Mapping[K, V]`, `Sequence[T]`,
`tuple[T, ...]` and unions of these.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import functools
import types
import typing
from typing import Any

from layout_core.errors import ConfigError

_ATOMS = {int: 'an int', float: 'a number', bool: 'True or False', str: 'a string',
          type(None): 'None'}


def _describe(hint: Any) -> str:
  if hint in _ATOMS:
    return _ATOMS[hint]
  origin, args = typing.get_origin(hint), typing.get_args(hint)
  if origin in (typing.Union, types.UnionType):
    return ' or '.join(_describe(a) for a in args)
  if origin in (collections.abc.Mapping, dict):
    return f'a dict of {_describe(args[0])} -> {_describe(args[1])}' if args else 'a dict'
  if origin in (collections.abc.Sequence, list, tuple):
    inner = args[0] if args else Any
    return f'a list of {_describe(inner)}' if inner is not Any else 'a list'
  return getattr(hint, '__name__', str(hint))


def matches(value: Any, hint: Any) -> bool:
  """True if `value` fits the type annotation `hint` (see module docstring)."""
  if hint is Any:
    return True
  if hint is int:
    return isinstance(value, int) and not isinstance(value, bool)
  if hint is float:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
  if hint in (bool, str, type(None)):
    return isinstance(value, hint)
  origin, args = typing.get_origin(hint), typing.get_args(hint)
  if origin in (typing.Union, types.UnionType):
    return any(matches(value, a) for a in args)
  if origin in (collections.abc.Mapping, dict):
    if not isinstance(value, collections.abc.Mapping):
      return False
    key, item = args or (Any, Any)
    return all(matches(k, key) and matches(v, item) for k, v in value.items())
  if origin in (collections.abc.Sequence, list, tuple):
    if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
      return False
    if origin is tuple and args and args[-1] is not Ellipsis:
      return len(value) == len(args) and all(matches(v, a) for v, a in zip(value, args))
    inner = args[0] if args else Any
    return all(matches(v, inner) for v in value)
  if isinstance(hint, type):
    return isinstance(value, hint)
  return True  # an annotation we do not check


def check_types(config: Any, *, name: str) -> None:
  """ConfigError for the first field of dataclass `config` whose value does
  not fit its annotation; `name` is the gin configurable (e.g. 'train')."""
  hints = _class_hints(type(config))
  for field in dataclasses.fields(config):
    value = getattr(config, field.name)
    hint = hints.get(field.name, Any)
    if not matches(value, hint):
      raise ConfigError(
          f'{name}.{field.name} = {value!r} is {_kind(value)}, but it must be '
          f'{_describe(hint)}', where=f'{name}.{field.name}',
          fix=f'give {name}.{field.name} {_describe(hint)}'
              + (f' (default {field.default!r})'
                 if field.default is not dataclasses.MISSING else ''))


def check_value(value: Any, hint: Any, *, parameter: str) -> None:
  """The same check for one plain function argument (e.g. a model builder's)."""
  if not matches(value, hint):
    raise ConfigError(f'{parameter} = {value!r} is {_kind(value)}, but it must be '
                      f'{_describe(hint)}', where=parameter,
                      fix=f'give {parameter} {_describe(hint)}')


@functools.lru_cache(maxsize=None)
def _class_hints(cls: type) -> dict[str, Any]:
  """A dataclass's resolved annotations, once per class (a `replace` checks
  them again: the layout suggester replaces configs thousands of times)."""
  return typing.get_type_hints(cls)


def check_arguments(function: Any, *, name: str, values: dict[str, Any]) -> None:
  """`check_types` for a configurable function: `values` (e.g. its `locals()`
  at entry) against its annotations; `name` is the gin configurable."""
  hints = typing.get_type_hints(function)
  for argument, value in values.items():
    if argument in hints:
      check_value(value, hints[argument], parameter=f'{name}.{argument}')


def at_least(config: Any, name: str, **minimums: float) -> None:
  """ConfigError naming `name.field` for each field below its minimum."""
  for field, minimum in minimums.items():
    value = getattr(config, field) if not isinstance(config, dict) else config[field]
    if value < minimum:
      raise ConfigError(f'{name}.{field} is {value}, but it must be at least {minimum}',
                        where=f'{name}.{field}', fix=f'use a value >= {minimum}')


def in_range(value: float, *, parameter: str, low: float, high: float,
             low_open: bool = False, high_open: bool = False) -> None:
  """ConfigError unless low <=/< value <=/< high."""
  above = value > low if low_open else value >= low
  below = value < high if high_open else value <= high
  if not (above and below):
    interval = f'{"(" if low_open else "["}{low}, {high}{")" if high_open else "]"}'
    raise ConfigError(f'{parameter} is {value}, outside {interval}', where=parameter,
                      fix=f'use a value in {interval}')


def _kind(value: Any) -> str:
  if value is None:
    return 'None'
  kind = type(value).__name__
  return f'an {kind}' if kind[0] in 'aeiou' else f'a {kind}'
