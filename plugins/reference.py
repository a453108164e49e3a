"""The configuration reference page, generated from the registered gin configurables.

    python -m plugins.reference > docs/reference/configuration.md

Every configurable in the `meshgin` gin module gets a section: what it builds
(the first paragraph of its docstring) and a table of every parameter gin can
bind, with its default and its description. Descriptions come from the code:
a dataclass field's comment (the one after the field, else the comment lines
directly above it), an `Args:`/`Attributes:` docstring section, or a layer's
`Params.Define` text. A description may name a constant of its module
(`REMAT_POLICIES`); the page shows its value (`'none' | 'block' | 'full'`).
Nothing here is typed by hand; `tests/test_docs_reference.py`
fails when the page on disk differs from this output.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import io
import re
import sys
import textwrap
import tokenize
from typing import Any, Callable

import gin

from layout_core.params import Params
import plugins.configurables as configurables

COMMAND = 'python -m plugins.reference > docs/reference/configuration.md'
_SECTION = re.compile(r'^(Args|Arguments|Attributes):\s*$')
_ENTRY = re.compile(r'^\s+(\*{0,2}\w+)(?:\s*\([^)]*\))?:\s*(.*)$')


def registered_names(module: str = configurables.MODULE) -> list[str]:
  """The configurables of gin module `module`: in the order of the table in
  `plugins/configurables.py`'s docstring, then any others alphabetically."""
  # gin offers no public listing of its registry: this and `_target` read it.
  registry = gin.config._REGISTRY  # pylint: disable=protected-access
  names = {c.name for _, c in registry.items() if c.module == module}
  table = [re.findall(r'`(\w+)`', line.split('|')[1])
           for line in configurables.__doc__.splitlines() if line.startswith('|')]
  ordered = list(dict.fromkeys(n for cell in table for n in cell if n in names))
  return ordered + sorted(names - set(ordered))


def _target(name: str, module: str = configurables.MODULE) -> Callable:
  return gin.config._REGISTRY[f'{module}.{name}'].wrapped  # pylint: disable=protected-access


def _value_text(value: Any) -> str:
  if isinstance(value, type) or (callable(value) and hasattr(value, '__qualname__')):
    return f'{value.__module__}.{value.__qualname__}'
  if isinstance(value, dict):  # insertion order is the meaning (mesh axes); keep it
    return '{' + ', '.join(f'{_value_text(k)}: {_value_text(v)}' for k, v in value.items()) + '}'
  if isinstance(value, Params):
    return f'{_value_text(value.cls)}.Params()'
  if isinstance(value, (list, tuple)):
    items = ', '.join(map(_value_text, value))
    return (f'[{items}]' if isinstance(value, list)
            else f'({items}{"," if len(value) == 1 else ""})')
  return repr(value)


def first_paragraph(obj: Any) -> str:
  doc = obj.__doc__ or ''
  if dataclasses.is_dataclass(obj) and doc.startswith(f'{obj.__name__}('):
    return ''  # the docstring dataclasses makes up from the signature
  paragraphs = inspect.cleandoc(doc).split('\n\n')
  text = ' '.join(paragraphs[0].split())
  if text.endswith(':') and len(paragraphs) > 1:  # the sentence goes on below
    text += ' ' + ' '.join(paragraphs[1].split())
  return text


def docstring_entries(obj: Any) -> dict[str, str]:
  """name -> text from the `Args:` / `Attributes:` sections of a docstring."""
  entries: dict[str, str] = {}
  current = None
  in_section = False
  for line in inspect.cleandoc(obj.__doc__ or '').splitlines():
    if _SECTION.match(line):
      in_section, current = True, None
    elif in_section and line.strip() and not line[0].isspace():
      in_section, current = False, None
    elif in_section and (match := _ENTRY.match(line)):
      current = match.group(1).lstrip('*')
      entries[current] = match.group(2).strip()
    elif in_section and current and line.strip():
      entries[current] = f'{entries[current]} {line.strip()}'.strip()
  return entries


def field_comments(cls: type) -> dict[str, str]:
  """field -> its comment: the one after it on its line(s), else the comment
  lines directly above it (no blank line between)."""
  source = textwrap.dedent(inspect.getsource(cls))
  lines = source.splitlines()
  trailing, own_line = {}, {}
  for tok in tokenize.generate_tokens(io.StringIO(source).readline):
    if tok.type == tokenize.COMMENT:
      text = tok.string.lstrip('#').strip()
      (own_line if tok.line.lstrip().startswith('#') else trailing)[tok.start[0]] = text
  comments = {}
  for node in ast.parse(source).body[0].body:
    if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
      continue
    after = [trailing[r] for r in range(node.lineno, node.end_lineno + 1) if r in trailing]
    above, row = [], node.lineno - 1
    while row in own_line and lines[row - 1].strip():
      above.insert(0, own_line[row])
      row -= 1
    comments[node.target.id] = ' '.join(after or above)
  return comments


def is_layer_builder(target: Any) -> bool:
  """A `plugins.registry.register_layer` function: every keyword defaults to
  its bare `object()` "unset" marker, and calling it bare gives the Params."""
  if inspect.isclass(target):
    return False
  values = inspect.signature(target).parameters.values()
  return bool(values) and all(type(p.default) is object for p in values)


def parameters(target: Any) -> list[tuple[str, str, str]]:
  """(name, default, description) for every parameter gin can bind."""
  signature = inspect.signature(target)
  if is_layer_builder(target):
    params = target()  # a registered layer: its Params, every key unset
    return [(key, _value_text(value), params.Doc(key)) for key, value in params.IterParams()
            if key in signature.parameters]
  docs = docstring_entries(target)
  if inspect.isclass(target):
    docs = {**docstring_entries(target.__init__), **docs}
  if dataclasses.is_dataclass(target):
    docs = {**field_comments(target), **{k: v for k, v in docs.items() if v}}
  factories = ({f.name: f.default_factory for f in dataclasses.fields(target)}
               if dataclasses.is_dataclass(target) else {})
  rows = []
  for name, p in signature.parameters.items():
    if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
      continue
    if p.default is inspect.Parameter.empty:
      default = 'required'
    elif factories.get(name, dataclasses.MISSING) is not dataclasses.MISSING:
      default = _value_text(factories[name]())
    else:
      default = _value_text(p.default)
    rows.append((name, default, docs.get(name, '')))
  return rows


_CONSTANT = re.compile(r'\b[A-Z][A-Z0-9_]*[A-Z0-9]\b')  # REMAT_POLICIES, not a lone T


def constant_text(value: Any) -> str | None:
  """How a code constant reads on the page (None: it has no short form):
  a tuple of choices as `'none' | 'block' | 'full'`, a count as `1,200,000`."""
  if isinstance(value, (tuple, list, frozenset)) and value and all(
      isinstance(v, (str, int, float)) and not isinstance(v, bool) for v in value):
    return ' | '.join(repr(v) for v in (sorted(value) if isinstance(value, frozenset) else value))
  if isinstance(value, int) and not isinstance(value, bool):
    return f'{value:,}'
  if isinstance(value, (str, float)):
    return repr(value)
  return None


def with_constant_values(text: str, *owners: Any) -> str:
  """`text` with every ALL_CAPS constant of the owners' modules replaced by its
  value: a comment may name `REMAT_POLICIES`, the page shows the choices."""
  namespace: dict[str, Any] = {}
  for owner in owners:
    namespace.update(vars(sys.modules[owner.__module__]))

  def value(match: re.Match) -> str:
    name = match.group(0)
    shown = constant_text(namespace[name]) if name in namespace else None
    return name if shown is None else shown
  return _CONSTANT.sub(value, text)


def _cell(text: str, code: bool = False) -> str:
  text = ' '.join(text.split()).replace('|', '\\|')
  return f'`{text}`' if code and text != 'required' and '`' not in text else text


def section(name: str) -> str:
  target = _target(name)
  built = target
  if is_layer_builder(target):
    built = target().cls  # a registered layer builds its class's Params
    what = f'Builds the Params of `{_value_text(built)}`'
  else:
    what = f'Builds `{_value_text(built)}`' if inspect.isclass(built) else \
        f'Calls `{_value_text(built)}`'
  summary = with_constant_values(first_paragraph(built), target, built)
  out = [f'## {name}', '', f'{what}{": " + summary if summary else "."}', '']
  rows = parameters(target)
  if not rows:
    return '\n'.join(out + ['No parameters.', ''])
  out += ['| parameter | default | description |', '|---|---|---|']
  out += [f'| `{p}` | {_cell(d, code=True)} | {_cell(with_constant_values(t, target, built))} |'
          for p, d, t in rows]
  return '\n'.join(out + [''])


def configuration_markdown() -> str:
  names = registered_names()
  head = [
      '# Configuration reference', '',
      f'This page is generated by `{COMMAND}` from the registered gin configurables '
      '(`plugins/configurables.py`); do not edit it by hand.', '',
      'Set a value in a `.gin` file as `configurable.parameter = value`, e.g. '
      '`train.num_steps = 300` (the full name `meshgin.train.num_steps` works too).', '',
      'Configurables: ' + ', '.join(f'[{n}](#{n})' for n in names) + '.', '']
  return '\n'.join(head + [section(n) for n in names])


if __name__ == '__main__':
  print(configuration_markdown(), end='')
