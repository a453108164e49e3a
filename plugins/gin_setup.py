"""Parsing gin files and bindings, with errors a user can act on.

    sources = parse_gin(files=['configs/experiments/quickstart.gin'],
                        bindings=['train.num_steps = 10'], search_paths=[])
    sources.where('train.num_steps')   # "--gin_bindings 'train.num_steps = 10'"

Before gin sees anything, every file (and everything it includes) is read
with gin's own statement parser, without binding anything, to report the
mistakes gin reports badly or not at all, each with its file and line: a
missing file (and which file includes it, on which line), an include cycle,
a syntax error or an unclosed bracket, an undefined macro. The walk also
records where every parameter was set, so any later `ConfigError` that names
`train.num_steps` can say "set in configs/x.gin, line 12" (`locate`).

gin's own errors are turned into `ConfigError`s with a "did you mean" for
misspelt configurables and parameters; the "In call to configurable ..."
noise gin appends to errors raised inside a configurable is dropped.

Search paths are also Python import roots: a .gin file's `import
my_project.layers` line finds `my_project/` in any --gin_search_paths
directory (or on PYTHONPATH), which is how users bring their own layers,
tasks and Keras models (docs/own-model.md).
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import importlib.util  # also for gin 0.5, which uses importlib.util without importing it
import inspect
import os
import re
import sys
import tokenize
from typing import Sequence

import gin
from gin import config_parser

from layout_core.errors import ConfigError
from plugins import configurables  # noqa: F401  registers the configurables

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_BINDING = re.compile(r'^([A-Za-z_][\w./@]*) = ')
_GIN_NOISE = re.compile(r"\s*In call to configurable '.*", re.DOTALL)
_PARAMETER = re.compile(r'\b((?:[A-Za-z_]\w*/)*[A-Za-z_]\w*)\.([A-Za-z_]\w*)\b')


# -- reading the sources ---------------------------------------------------------
class _Recorder(config_parser.ParserDelegate):
  """Parses values without looking anything up; remembers the macros used."""

  def __init__(self):
    self.macros: list[str] = []

  def configurable_reference(self, scoped_name, evaluate):
    return f'@{scoped_name}'

  def macro(self, name):
    self.macros.append(name)
    return f'%{name}'


@dataclasses.dataclass
class GinSources:
  """What the config files and bindings say, before gin binds it."""
  files: list[str] = dataclasses.field(default_factory=list)  # every file read, in order
  locations: dict[str, str] = dataclasses.field(default_factory=dict)  # 'x.y' -> where set
  macros_defined: set[str] = dataclasses.field(default_factory=set)
  macros_used: list[tuple[str, str]] = dataclasses.field(default_factory=list)  # (name, where)

  def where(self, parameter: str) -> str | None:
    """Where `parameter` ('train.num_steps', 'narrow/transformer_block.ffn_dim') was
    last set, or None if it keeps its default."""
    return self.locations.get(parameter)

  def locate(self, error: ConfigError) -> ConfigError:
    """`error` without gin's noise and with where its parameter was set."""
    text = _GIN_NOISE.sub('', str(error)).strip()
    where = re.search(r'Where: (.*?)\.(?= Fix:|$)', text)
    for match in _PARAMETER.finditer(where.group(1) if where else text):
      location = self.where(match.group(0))
      if location and location not in text:
        note = f'{match.group(0)} is set in {location}'
        if where:
          return ConfigError(text[:where.end(1)] + f' ({note})' + text[where.end(1):])
        return ConfigError(f'{text.rstrip(".")}. Where: {note}')
    return ConfigError(text)


def find_gin_file(name: str, paths: Sequence[str]) -> str | None:
  """`name`'s absolute path, in gin's order: itself (from the current
  directory), then as a file of an importable package (`configs/runs/x.gin`
  in the `configs` package that ships with meshgin, checkout or installed),
  then under each search path in turn; None if nowhere."""
  for candidate in [name, _in_package(name)] + [os.path.join(p, name) for p in paths]:
    if candidate and os.path.isfile(candidate):
      return os.path.abspath(candidate)
  return None


def _in_package(name: str) -> str | None:
  """Where gin's package reader looks for `name`: `a/b/x.gin` in package
  `a.b`'s directory. None for a name it does not read, or no such package."""
  head, filename = os.path.split(name)
  if not head or os.path.isabs(name) or '.' in head:
    return None
  try:
    spec = importlib.util.find_spec(head.replace('/', '.'))
  except (ImportError, ValueError):
    return None
  if spec is None or not spec.origin:
    return None
  return os.path.join(os.path.dirname(spec.origin), filename)


def _display(path: str) -> str:
  relative = os.path.relpath(path)
  return relative if not relative.startswith('..') else path


def _statements(text: str, origin: str, recorder: _Recorder):
  """gin's statements of `text`, each with the macros its value uses."""
  parser = config_parser.ConfigParser(text, recorder)
  try:
    for statement in parser:
      used, recorder.macros = recorder.macros, []
      yield statement, used
  except tokenize.TokenError:
    raise ConfigError(f'{origin} has an unclosed bracket or string',
                      where=origin, fix='close every (, [, { and quote') from None
  except SyntaxError as e:
    line = f', line {e.lineno}' if e.lineno else ''
    detail = str(e.msg if hasattr(e, 'msg') else e)
    raise ConfigError(f'{origin}{line}: {detail}', where=f'{origin}{line}',
                      fix='gin statements are `configurable.parameter = value`, '
                          "`include 'file.gin'` or `import module`") from None


def _record(sources: GinSources, statement, used: list[str], where: str) -> None:
  if isinstance(statement, config_parser.BindingStatement):
    selector = statement.selector.split('.')[-1]
    if not statement.arg_name:  # a macro definition: NAME = value
      sources.macros_defined.add(statement.selector)
    else:
      key = f'{selector}.{statement.arg_name}'
      if statement.scope:
        sources.locations[f'{statement.scope}/{key}'] = where
        sources.locations.setdefault(key, where)
      else:
        sources.locations[key] = where
  sources.macros_used += [(name, where) for name in used]


def _read_file(path: str, sources: GinSources, paths: Sequence[str],
               stack: list[tuple[str, str]]) -> None:
  sources.files.append(path)
  with open(path) as f:
    text = f.read()
  recorder = _Recorder()
  for statement, used in _statements(text, _display(path), recorder):
    line = statement.location.line_num
    where = f'{_display(path)}, line {line}'
    if isinstance(statement, config_parser.IncludeStatement):
      target = find_gin_file(statement.filename, paths)
      if target is None:
        raise ConfigError(
            f"{where} includes '{statement.filename}', which does not exist",
            where=where, fix='fix the name, or add its directory to --gin_search_paths '
                             f'(searched: {", ".join(paths)})')
      chain = [p for p, _ in stack] + [path]
      if target in chain:
        cycle = ' -> '.join(f'{_display(p)} (line {l})' for p, l in
                            stack[chain.index(target):] + [(path, str(line))])
        raise ConfigError(f'include cycle: {cycle} -> {_display(target)}', where=where,
                          fix='remove one of these include statements')
      _read_file(target, sources, paths, stack + [(path, str(line))])
    else:
      _record(sources, statement, used, where)


def read_sources(*, files: Sequence[str], bindings: Sequence[str],
                 search_paths: Sequence[str]) -> GinSources:
  """Walks files, includes and bindings without binding anything (see module doc)."""
  sources = GinSources()
  paths = list(dict.fromkeys(list(search_paths) + [os.getcwd(), REPO_ROOT]))
  for name in files:
    path = find_gin_file(name, paths)
    if path is None:
      raise ConfigError(f'gin file {name!r} not found', where='--gin_file',
                        fix=f'check the path or add --gin_search_paths (searched: '
                            f'{", ".join(paths)})')
    _read_file(path, sources, paths, stack=[])
  for binding in bindings:
    where = f'--gin_bindings {binding!r}'
    recorder = _Recorder()
    for statement, used in _statements(binding, where, recorder):
      if isinstance(statement, config_parser.IncludeStatement):
        raise ConfigError(f'{where} is an include', where=where,
                          fix='pass the file with --gin_file instead')
      _record(sources, statement, used, where)
  known_constants = gin.config._CONSTANTS  # pylint: disable=protected-access
  for name, where in sources.macros_used:
    if (name not in sources.macros_defined and name != 'gin.REQUIRED'
        and not known_constants.matching_selectors(name)):
      raise ConfigError(f"macro %{name} is used in {where} but never defined",
                        where=where,
                        fix=f'define it, e.g. `{name} = 100` in a .gin file or '
                            f"--gin_bindings='{name} = 100'")
  return sources


# -- gin's errors -------------------------------------------------------------------
def _registered_names() -> list[str]:
  registry = gin.config._REGISTRY  # pylint: disable=protected-access
  return [selector.split('.')[-1] for selector, _ in registry.items()
          if not selector.startswith('gin.')]


def _suggest(name: str, choices: Sequence[str]) -> str:
  close = difflib.get_close_matches(name, list(choices), n=1, cutoff=0.5)
  return f" Did you mean '{close[0]}'?" if close else ''


def _parameters_of(configurable_name: str) -> list[str]:
  try:
    selector = gin.config._REGISTRY.get_match(configurable_name)  # pylint: disable=protected-access
    target = selector.wrapped
  except Exception:  # pylint: disable=broad-except
    return []
  try:
    return list(inspect.signature(target).parameters)
  except (TypeError, ValueError):
    return []


def explain_gin_error(error: BaseException) -> ConfigError:
  """A ConfigError for a gin parse/bind error, with suggestions added."""
  text = _GIN_NOISE.sub('', str(error)).strip()
  hint = ''
  unknown_configurable = re.search(r"No configurable matching (?:reference )?'@?([^'(]+)",
                                   text)
  unknown_parameter = re.search(
      r"Configurable '([^']+)' doesn't have a parameter named '([^']+)'", text)
  if unknown_configurable:
    name = unknown_configurable.group(1).split('.')[-1].split('/')[-1]
    hint = _suggest(name, _registered_names())
    hint += ' Configurables: ' + ', '.join(sorted(set(_registered_names()))) + '.'
  elif unknown_parameter:
    configurable, parameter = unknown_parameter.groups()
    known = _parameters_of(configurable)
    hint = _suggest(parameter, known)
    if known:
      hint += f" '{configurable}' takes: {', '.join(known)}."
  elif isinstance(error, RuntimeError) and 'Required bindings' in text:
    hint = ' Set them in a .gin file or with --gin_bindings.'
  text = ' '.join(text.split())
  if hint and not text.endswith(('.', '?', '!')):
    text += '.'  # gin's text ends where the hint starts a sentence
  return ConfigError('gin config error: ' + text + hint)


def parse_gin(*, files: Sequence[str], bindings: Sequence[str],
              search_paths: Sequence[str] = ()) -> GinSources:
  """Clears gin, checks the sources (`read_sources`), then parses `files` and
  `bindings` into gin; raises ConfigError."""
  gin.clear_config()
  sources = read_sources(files=files, bindings=bindings, search_paths=search_paths)
  for path in list(search_paths) + [os.getcwd(), REPO_ROOT]:
    gin.add_config_file_search_path(path)
  add_import_roots(search_paths)
  try:
    gin.parse_config_files_and_bindings(list(files), list(bindings),
                                        finalize_config=False)
  except ImportError as e:
    raise ConfigError(f"a gin file's import failed: {' '.join(str(e).split())}",
                      fix='put the directory holding the package on --gin_search_paths '
                          'or PYTHONPATH') from e
  except (ValueError, SyntaxError, IOError, AttributeError, TypeError,
          tokenize.TokenError) as e:
    raise explain_gin_error(e) from e
  return sources


def add_import_roots(search_paths: Sequence[str]) -> None:
  """Puts each existing search-path directory on sys.path (once, at the end)."""
  for path in search_paths:
    directory = os.path.abspath(path)
    if os.path.isdir(directory) and directory not in sys.path:
      sys.path.append(directory)


@contextlib.contextmanager
def parsed_config(*, files: Sequence[str], bindings: Sequence[str],
                  search_paths: Sequence[str] = ()):
  """`parse_gin`, then a block whose ConfigErrors say where the parameter
  they name was set (`GinSources.locate`):

      with parsed_config(files=[...], bindings=[...]):
        plan = make_plan()
  """
  sources = parse_gin(files=files, bindings=bindings, search_paths=search_paths)
  try:
    yield sources
  except ConfigError as e:
    raise sources.locate(e) from None
  except RuntimeError as e:
    if 'Required bindings' not in str(e):
      raise
    raise sources.locate(explain_gin_error(e)) from None


def without_settings(operative_config: str, names: Sequence[str]) -> str:
  """The operative config without the bindings of `names` (one-line values)."""
  starts = tuple(f'{name} = ' for name in names)
  return ''.join(line for line in operative_config.splitlines(keepends=True)
                 if not line.startswith(starts))


def gin_settings(operative_config: str) -> dict[str, str]:
  """{'train.num_steps': '300', ...}: one entry per binding of a gin operative
  config (a value spread over several lines is joined)."""
  settings: dict[str, str] = {}
  current = None
  for line in operative_config.splitlines():
    match = _BINDING.match(line)
    if match:
      current = match.group(1)
      settings[current] = line[match.end():].strip()
    elif current and line.strip() and not line.startswith('#'):
      settings[current] += ' ' + line.strip()
    elif not line.strip() or line.startswith('#'):
      current = None
  return settings
