"""Lingvo-style hyper-parameter trees.

A `Params` object is a typed, documented, freezable namespace. Layers describe
their knobs with `Define`, configs change them with `Set` (dotted keys reach
into nested params), and `Instantiate` builds the class named by `cls`.

    p = Params()
    p.Define('name', 'ffn', 'Layer name; also the variable path component.')
    p.Define('hidden_dim', 256, 'Width of the inner projection.')
    p.Set(hidden_dim=512)
    p.hidden_dmi = 3   # ConfigError: no param 'hidden_dmi'; did you mean 'hidden_dim'?
    print(p.ToText())  # hidden_dim : 512 / name : 'ffn'

Nested params, lists of params (explicit pipeline cells) and plain values may
be mixed freely; `ToText` flattens them all to `dotted.key : value` lines so two
configs can be compared with `TextDiff`.
"""

from __future__ import annotations

import copy
import difflib
from typing import Any, Iterator

from layout_core.errors import ConfigError


class _Param:
  __slots__ = ('value', 'doc')

  def __init__(self, value: Any, doc: str):
    self.value = value
    self.doc = doc


def _did_you_mean(name: str, choices: list[str]) -> str:
  close = difflib.get_close_matches(name, choices, n=1, cutoff=0.6)
  return f"; did you mean '{close[0]}'?" if close else ''


def _value_text(value: Any) -> str:
  if isinstance(value, type):
    return f'{value.__module__}.{value.__qualname__}'
  if callable(value) and hasattr(value, '__qualname__'):
    return f'{value.__module__}.{value.__qualname__}'
  return repr(value)


class Params:
  """A tree of named, documented hyper-parameters (see the module docstring).

  Values are read and set as attributes (`p.hidden_dim`, `p.name = 'ffn'`);
  only defined names exist, and a misspelt one is an error that suggests the
  closest. A layer's params come from its class (`FeedForward.Params()`),
  are changed with `Set` (or gin, through `plugins.registry.register_layer`)
  and built with `Instantiate`:

      p = FeedForward.Params().Set(name='ffn', input_dim=64)
      p.hidden_dim = 512
      layer = p.Instantiate(parent_path='model')   # FeedForward(p, parent_path=...)
  """

  def __init__(self):
    object.__setattr__(self, '_params', {})
    object.__setattr__(self, '_frozen', False)

  # -- definition -------------------------------------------------------------
  def Define(self, name: str, default: Any, doc: str) -> None:
    """Adds a new parameter `name` with a default value and a docstring.

        p.Define('output_dim', 32, 'Output width.')

    Args:
      name: A public identifier, not yet defined here.
      default: Its value until set: a plain value, nested `Params` or a list
        of `Params`.
      doc: What it means, for `Doc` and the reader of the layer.

    Raises:
      ConfigError: The params are frozen, `name` is not a public identifier,
        or it is already defined.
    """
    if self._frozen:
      raise ConfigError(f"cannot Define '{name}' on frozen params")
    if not name.isidentifier() or name.startswith('_'):
      raise ConfigError(f"param name {name!r} must be a public identifier")
    if name in self._params:
      raise ConfigError(f"param '{name}' is already defined")
    self._params[name] = _Param(default, doc)

  # -- access -----------------------------------------------------------------
  def _lookup(self, name: str) -> _Param:
    try:
      return self._params[name]
    except KeyError:
      raise AttributeError(
          f"no param '{name}'{_did_you_mean(name, list(self._params))} "
          f"(defined: {', '.join(sorted(self._params))})") from None

  def __getattr__(self, name: str) -> Any:
    if name.startswith('__'):
      raise AttributeError(name)
    return self._lookup(name).value

  def __setattr__(self, name: str, value: Any) -> None:
    if self._frozen:
      raise ConfigError(f"cannot set '{name}': params are frozen",
                        fix='call Copy() and change the copy')
    try:
      self._lookup(name).value = value
    except AttributeError as e:
      raise ConfigError(str(e)) from None

  def __contains__(self, name: str) -> bool:
    return name in self._params

  def __dir__(self):
    return sorted(self._params)

  def _resolve(self, dotted: str) -> tuple['Params', str]:
    """Returns (params holding the leaf, leaf name) for 'a.b.c' or 'cells[1].x'."""
    node, *rest = dotted.split('.')
    holder: Params = self
    for part in rest:
      holder = holder._child(node, dotted)
      node = part
    return holder, node

  def _child(self, key: str, dotted: str) -> 'Params':
    name, index = key, None
    if key.endswith(']') and '[' in key:
      name, index_text = key[:-1].split('[', 1)
      if not index_text.isdigit():
        raise ConfigError(f"in '{dotted}': index [{index_text}] is not a number",
                          fix=f"write e.g. '{name}[0]'")
      index = int(index_text)
    try:
      value = self._lookup(name).value
    except AttributeError as e:
      raise ConfigError(f"in '{dotted}': {e}") from None
    if index is not None:
      if not isinstance(value, (list, tuple)):
        raise ConfigError(f"in '{dotted}': '{name}' is a {type(value).__name__}, not a "
                          'list', fix=f"drop the index: '{name}'")
      if not index < len(value):
        raise ConfigError(f"in '{dotted}': '{name}' has {len(value)} entries, so "
                          f'[{index}] does not exist', fix=f'use an index below {len(value)}')
      value = value[index]
    if not isinstance(value, Params):
      raise ConfigError(f"in '{dotted}': '{key}' is a {type(value).__name__}, "
                        'not nested params')
    return value

  def Get(self, dotted: str) -> Any:
    """Returns the value at a dotted path, e.g. `p.Get('stack.block.ffn.hidden_dim')`
    or, into a list of params, `p.Get('cells[1].name')`."""
    holder, leaf = self._resolve(dotted)
    try:
      return holder._lookup(leaf).value
    except AttributeError as e:
      raise ConfigError(f"in '{dotted}': {e}") from None

  def Set(self, **kwargs: Any) -> 'Params':
    """Sets values; keys may be dotted (`p.Set(**{'ffn.hidden_dim': 8})`).

    Dotted keys may also be written with '__' in place of '.' so that plain
    keyword syntax works: `p.Set(ffn__hidden_dim=8)`.

        p = GatedDense.Params().Set(name='gate', output_dim=16)

    Args:
      **kwargs: {key: value}: each key a defined name, or a dotted path into
        nested params.

    Returns:
      self, so calls chain.

    Raises:
      ConfigError: The params are frozen, or a key is not defined (the
        message suggests the closest defined name).
    """
    for key, value in kwargs.items():
      holder, leaf = self._resolve(key.replace('__', '.'))
      setattr(holder, leaf, value)
    return self

  def IterParams(self) -> Iterator[tuple[str, Any]]:
    """(name, value) of each parameter, in definition order (not nested)."""
    for name, param in self._params.items():
      yield name, param.value

  def Doc(self, name: str) -> str:
    """The docstring `name` was defined with."""
    return self._lookup(name).doc

  # -- lifecycle ----------------------------------------------------------------
  def Copy(self) -> 'Params':
    """A deep, unfrozen copy; classes and functions are shared, not copied."""
    clone = Params()
    for name, param in self._params.items():
      clone._params[name] = _Param(_copy_value(param.value), param.doc)
    return clone

  def Freeze(self) -> 'Params':
    """Makes this tree (and every nested Params) read-only. Returns self."""
    object.__setattr__(self, '_frozen', True)
    for _, value in self.IterParams():
      for nested in _nested_params(value):
        nested.Freeze()
    return self

  def IsFrozen(self) -> bool:
    """Whether `Freeze` made these params read-only."""
    return self._frozen

  def Instantiate(self, **kwargs: Any) -> Any:
    """Builds `self.cls(self, **kwargs)`.

        layer = p.Instantiate(parent_path='model')   # a built BaseLayer

    Args:
      **kwargs: Passed on to the class, e.g. a layer's `parent_path`.

    Returns:
      The object built (for a layer's params, the built layer).

    Raises:
      ConfigError: The params define no `cls`, or it is None.
    """
    if 'cls' not in self._params or self.cls is None:
      raise ConfigError('params have no cls to instantiate',
                        fix="Define('cls', ...) or build from SomeLayer.Params()")
    return self.cls(self, **kwargs)

  # -- text -------------------------------------------------------------------
  def _flatten(self, prefix: str = '') -> Iterator[tuple[str, str]]:
    for name in sorted(self._params):
      value = self._params[name].value
      key = f'{prefix}{name}'
      if isinstance(value, Params):
        yield from value._flatten(key + '.')
      elif (isinstance(value, (list, tuple)) and value and
            all(isinstance(v, Params) for v in value)):
        for i, item in enumerate(value):
          yield from item._flatten(f'{key}[{i}].')
      else:
        yield key, _value_text(value)

  def ToText(self) -> str:
    """One `dotted.key : value` line per leaf, sorted; nested params flattened."""
    return ''.join(f'{k} : {v}\n' for k, v in self._flatten())

  def TextDiff(self, other: 'Params') -> str:
    """Lines `- key : old` / `+ key : new` for every leaf that differs."""
    mine, theirs = dict(self._flatten()), dict(other._flatten())
    lines = []
    for key in sorted(set(mine) | set(theirs)):
      if mine.get(key) != theirs.get(key):
        if key in mine:
          lines.append(f'- {key} : {mine[key]}')
        if key in theirs:
          lines.append(f'+ {key} : {theirs[key]}')
    return ''.join(line + '\n' for line in lines)

  def __eq__(self, other: object) -> bool:
    return isinstance(other, Params) and self.ToText() == other.ToText()

  def __repr__(self) -> str:
    return 'Params(\n' + ''.join(f'  {line}\n' for line in
                                 self.ToText().splitlines()) + ')'

  def __getstate__(self):
    return {'params': self._params, 'frozen': self._frozen}

  def __setstate__(self, state):
    object.__setattr__(self, '_params', state['params'])
    object.__setattr__(self, '_frozen', state['frozen'])


def _nested_params(value: Any) -> list[Params]:
  if isinstance(value, Params):
    return [value]
  if isinstance(value, (list, tuple)):
    return [v for v in value if isinstance(v, Params)]
  if isinstance(value, dict):
    return [v for v in value.values() if isinstance(v, Params)]
  return []


def _copy_value(value: Any) -> Any:
  if isinstance(value, Params):
    return value.Copy()
  if isinstance(value, list):
    return [_copy_value(v) for v in value]
  if isinstance(value, tuple):
    return tuple(_copy_value(v) for v in value)
  if isinstance(value, dict):
    return {k: _copy_value(v) for k, v in value.items()}
  if isinstance(value, type) or callable(value):
    return value
  return copy.deepcopy(value)


def once_per_frozen(cache: dict, p: 'Params', key, make):
  """`make()`, kept in `cache` under `key` (its first part `id(p)`) while `p`
  is frozen, so a frozen tree's derived values (leaves, FLOPs, texts) are
  worked out once; an unfrozen `p`'s are made afresh each time. The cache
  holds `p` itself, so its id is not reused while the entry lives."""
  if not p.IsFrozen():
    return make()
  hit = cache.get(key)
  if hit is None or hit[0] is not p:
    if len(cache) >= 4096:
      cache.clear()
    hit = cache[key] = (p, make())
  return hit[1]
