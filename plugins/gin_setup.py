"""Parsing gin files and bindings, with errors a user can act on.

    parse_gin(files=['configs/experiments/quickstart.gin'],
              bindings=['train.num_steps = 10'], search_paths=[])

gin's own errors are turned into `ConfigError`s that keep gin's location
("In file ..., line N") and add a "did you mean" for misspelt configurables
and parameters, and the search paths tried for a missing file.

Search paths are also Python import roots: a .gin file's `import
my_project.layers` line finds `my_project/` in any --gin_search_paths
directory (or on PYTHONPATH), which is how users bring their own layers,
tasks and Keras models (README, "Your own model").
"""

from __future__ import annotations

import difflib
import importlib.util  # noqa: F401  gin 0.5 uses importlib.util without importing it
import inspect
import os
import re
import sys
from typing import Sequence

import gin

from layout_core.errors import ConfigError
from plugins import configurables  # noqa: F401  registers the configurables

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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


def explain_gin_error(error: Exception) -> ConfigError:
  """A ConfigError for a gin parse/bind error, with suggestions added."""
  text = str(error).strip()
  hint = ''
  unknown_configurable = re.search(r"No configurable matching '([^']+)'", text)
  unknown_parameter = re.search(
      r"Configurable '([^']+)' doesn't have a parameter named '([^']+)'", text)
  if unknown_configurable:
    name = unknown_configurable.group(1).split('.')[-1]
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
  return ConfigError('gin config error: ' + text.replace('\n', ' ').replace('  ', ' ') + hint)


def parse_gin(*, files: Sequence[str], bindings: Sequence[str],
              search_paths: Sequence[str] = ()) -> None:
  """Clears gin and parses `files` then `bindings`; raises ConfigError."""
  gin.clear_config()
  paths = list(search_paths) + [os.getcwd(), REPO_ROOT]
  for path in dict.fromkeys(paths):
    gin.add_config_file_search_path(path)
  for name in files:
    if not any(os.path.isfile(os.path.join(p, name)) for p in [''] + paths):
      raise ConfigError(f'gin file {name!r} not found',
                        where=f'searched {", ".join(dict.fromkeys(paths))}',
                        fix='check the path or add --gin_search_paths')
  add_import_roots(search_paths)
  try:
    gin.parse_config_files_and_bindings(list(files), list(bindings),
                                        finalize_config=False)
  except ImportError as e:
    raise ConfigError(f"a gin file's import failed: {' '.join(str(e).split())}",
                      fix='put the directory holding the package on --gin_search_paths '
                          'or PYTHONPATH') from e
  except (ValueError, SyntaxError, IOError, AttributeError, TypeError) as e:
    raise explain_gin_error(e) from e


def add_import_roots(search_paths: Sequence[str]) -> None:
  """Puts each existing search-path directory on sys.path (once, at the end)."""
  for path in search_paths:
    directory = os.path.abspath(path)
    if os.path.isdir(directory) and directory not in sys.path:
      sys.path.append(directory)
