"""`layout_core` imports run one way: no cycle between its modules or between
its subpackages, and nothing in `train/` imports `pipeline/` (the pipeline
engines build on the training loop, not the other way round; the factory
that picks an engine sits above both, in `layout_core.run`).

The imports are read from the source with `ast` (no module is imported, no
TensorFlow), function-level deferred imports included: an import moved into
a function to dodge a cycle is still that cycle.

    python -m pytest tests/test_imports.py -q
"""

from __future__ import annotations

import ast
import os

from tests.conftest import REPO_ROOT

PACKAGE = 'layout_core'
# (importing subpackage, imported subpackage) pairs that must never occur.
FORBIDDEN = [('layout_core.train', 'layout_core.pipeline')]


def module_files(root: str = os.path.join(REPO_ROOT, PACKAGE)) -> dict[str, str]:
  """Dotted module name -> path, for every .py file under `root`."""
  files = {}
  for directory, _, names in os.walk(root):
    for name in names:
      if not name.endswith('.py'):
        continue
      path = os.path.join(directory, name)
      parts = os.path.relpath(path, REPO_ROOT)[:-len('.py')].split(os.sep)
      if parts[-1] == '__init__':
        parts = parts[:-1]
      files['.'.join(parts)] = path
  return files


def imported_modules(module: str, path: str, known: set[str]) -> dict[str, int]:
  """The `layout_core` modules `module` imports anywhere in its file
  (top level or inside functions), each with the line of its first import.
  `from package import name` counts as importing `package.name` when that is
  a module, else `package` itself."""
  tree = ast.parse(open(path, encoding='utf-8').read(), filename=path)
  is_package = path.endswith('__init__.py')
  found: dict[str, int] = {}

  def add(name: str, line: int) -> None:
    if name in known and name != module:
      found.setdefault(name, line)

  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      for alias in node.names:
        add(alias.name, node.lineno)
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ''
      if node.level:  # relative: resolved against this module's package
        anchor = module.split('.')
        anchor = anchor[:len(anchor) - node.level + (1 if is_package else 0)]
        base = '.'.join(anchor + ([base] if base else []))
      for alias in node.names:
        submodule = f'{base}.{alias.name}'
        add(submodule if submodule in known else base, node.lineno)
  return found


def import_graph() -> dict[str, dict[str, int]]:
  """module -> {imported module: line} over every module of `layout_core`."""
  files = module_files()
  known = set(files)
  return {module: imported_modules(module, path, known) for module, path in files.items()}


def subpackage(module: str) -> str:
  """`layout_core.train.loop` -> `layout_core.train`; a top-level module
  (`layout_core.errors`) is its own unit, and so is the package's __init__."""
  parts = module.split('.')
  return '.'.join(parts[:2])


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
  """The strongly connected components of more than one node (and nodes
  that import themselves), each as a sorted list: every import cycle."""
  index: dict[str, int] = {}
  low: dict[str, int] = {}
  stack: list[str] = []
  on_stack: set[str] = set()
  found: list[list[str]] = []
  counter = [0]

  def visit(node: str) -> None:  # Tarjan's algorithm
    index[node] = low[node] = counter[0]
    counter[0] += 1
    stack.append(node)
    on_stack.add(node)
    for target in sorted(graph.get(node, ())):
      if target not in index:
        visit(target)
        low[node] = min(low[node], low[target])
      elif target in on_stack:
        low[node] = min(low[node], index[target])
    if low[node] == index[node]:
      component = []
      while True:
        member = stack.pop()
        on_stack.discard(member)
        component.append(member)
        if member == node:
          break
      if len(component) > 1 or node in graph.get(node, ()):
        found.append(sorted(component))

  for node in sorted(graph):
    if node not in index:
      visit(node)
  return found


def describe(component: list[str], graph: dict[str, dict[str, int]] | None,
             edges: dict[str, set[str]]) -> str:
  """One cycle's members and the imports inside it (with lines, for modules)."""
  members = set(component)
  lines = []
  for source in component:
    for target in sorted(edges.get(source, set()) & members):
      where = f' (line {graph[source][target]})' if graph else ''
      lines.append(f'  {source} -> {target}{where}')
  return ' <-> '.join(component) + '\n' + '\n'.join(lines)


def subpackage_edges(graph: dict[str, dict[str, int]]) -> dict[str, set[str]]:
  """subpackage -> the other subpackages its modules import."""
  edges: dict[str, set[str]] = {}
  for source, targets in graph.items():
    for target in targets:
      a, b = subpackage(source), subpackage(target)
      if a != b:
        edges.setdefault(a, set()).add(b)
  return edges


def test_the_walk_sees_deferred_and_relative_imports(tmp_path):
  """Positive control for the walker: an import inside a function and a
  relative import are both found, and a two-module cycle is reported."""
  package = tmp_path / 'pkg'
  package.mkdir()
  (package / '__init__.py').write_text('')
  (package / 'a.py').write_text('def later():\n  from pkg import b\n')
  (package / 'b.py').write_text('from . import a\n')
  known = {'pkg', 'pkg.a', 'pkg.b'}
  a = imported_modules('pkg.a', str(package / 'a.py'), known)
  b = imported_modules('pkg.b', str(package / 'b.py'), known)
  assert a == {'pkg.b': 2} and b == {'pkg.a': 1}
  assert cycles({'pkg.a': set(a), 'pkg.b': set(b)}) == [['pkg.a', 'pkg.b']]


def test_the_walk_covers_the_whole_package():
  """Every subpackage is seen, with the imports everyone knows are there."""
  graph = import_graph()
  assert {subpackage(m) for m in graph} >= {
      f'{PACKAGE}.{name}' for name in ('train', 'pipeline', 'layout', 'model', 'tasks',
                                       'checkpoint', 'run')}
  assert 'layout_core.train.engine' in graph['layout_core.pipeline.engines']


def test_no_import_cycle_between_modules():
  graph = import_graph()
  edges = {source: set(targets) for source, targets in graph.items()}
  found = cycles(edges)
  assert not found, 'import cycles between modules:\n' + '\n'.join(
      describe(c, graph, edges) for c in found)


def test_no_import_cycle_between_subpackages():
  graph = import_graph()
  edges = subpackage_edges(graph)
  found = cycles(edges)
  if found:  # name the module imports that make each subpackage cycle
    report = []
    for component in found:
      members = set(component)
      report.append(' <-> '.join(component))
      report += [f'  {source} -> {target} (line {line})'
                 for source, targets in sorted(graph.items())
                 for target, line in sorted(targets.items())
                 if subpackage(source) in members and subpackage(target) in members
                 and subpackage(source) != subpackage(target)]
    raise AssertionError('import cycles between subpackages:\n' + '\n'.join(report))


def test_train_does_not_import_pipeline():
  graph = import_graph()
  bad = [f'{source} -> {target} (line {line})'
         for source, targets in sorted(graph.items())
         for target, line in sorted(targets.items())
         for importer, imported in FORBIDDEN
         if subpackage(source) == importer and subpackage(target) == imported]
  assert not bad, 'layout_core.train must not import layout_core.pipeline:\n' + '\n'.join(bad)
