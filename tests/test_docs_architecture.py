"""docs/architecture.md's package table names every module, and only modules
that exist: each `.py` file under layout_core/, plugins/ and launch/ (less
`__init__.py`) is named in the row of its package, as `file.py`, and every
`*.py` a row names is a file under that row's package. Reads files only: no
TensorFlow, no imports of the project."""

from __future__ import annotations

import glob
import os
import re

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGE = os.path.join(REPO_ROOT, 'docs', 'architecture.md')
PACKAGES = ('layout_core', 'plugins', 'launch')
SECTION = '## Packages and modules'


def table_rows(text: str) -> list[tuple[str, str]]:
  """(package folder, modules cell) of each row of the section's table whose
  first cell names a folder (`layout_core/layout/`)."""
  assert f'\n{SECTION}\n' in text, f'docs/architecture.md has no "{SECTION}" section'
  body = text.split(f'\n{SECTION}\n', 1)[1].split('\n## ', 1)[0]
  rows = []
  for line in body.splitlines():
    cells = [c.strip() for c in line.strip().strip('|').split('|')]
    if not line.startswith('|') or len(cells) < 2:
      continue
    folder = re.match(r'`([\w./]+/)`', cells[0])
    if folder:
      rows.append((folder.group(1), '|'.join(cells[1:])))
  return rows


def named_modules(text: str) -> dict[str, str]:
  """Repository path of every `*.py` the table names -> the row's package.
  A name is relative to its row's folder (`mesh.py`, `classifier/write_data.py`)
  unless it starts at a top-level folder of the repository (`tests/test_imports.py`)."""
  top_level = {entry for entry in os.listdir(REPO_ROOT)
               if os.path.isdir(os.path.join(REPO_ROOT, entry))}
  named = {}
  for folder, cell in table_rows(text):
    for name in re.findall(r'`([\w./]+\.py)`', cell):
      from_root = name.split('/', 1)[0] in top_level and '/' in name
      named[os.path.normpath(name if from_root else folder + name)] = folder
  return named


def modules_on_disk() -> set[str]:
  found = set()
  for package in PACKAGES:
    for path in glob.glob(os.path.join(REPO_ROOT, package, '**', '*.py'), recursive=True):
      if os.path.basename(path) != '__init__.py':
        found.add(os.path.relpath(path, REPO_ROOT))
  return found


def _page() -> str:
  with open(PAGE, encoding='utf-8') as f:
    return f.read()


def test_every_module_on_disk_is_in_the_table():
  named = named_modules(_page())
  missing = sorted(modules_on_disk() - set(named))
  assert not missing, (
      'docs/architecture.md\'s "Packages and modules" table does not name: '
      + ', '.join(missing) + '. Add each as `file.py` (what it is for) to the row of its '
      'package folder (a module in a new folder: a new row).')


def test_every_module_in_the_table_exists():
  named = named_modules(_page())
  gone = sorted(f'{path} (row {folder})' for path, folder in named.items()
                if not os.path.isfile(os.path.join(REPO_ROOT, path)))
  assert not gone, ('docs/architecture.md\'s "Packages and modules" table names modules '
                    'that do not exist: ' + ', '.join(gone) + '. Remove or rename them.')


def test_the_check_sees_a_missing_and_a_stale_module():
  """Positive control: drop one module from the real table and add a made-up
  one; the two checks' inputs then show exactly those."""
  text = _page()
  assert '`agreement.py` (' in text
  changed = text.replace('`agreement.py` (', '`agreemnt_gone.py` (', 1)
  named = named_modules(changed)
  assert 'plugins/agreement.py' in modules_on_disk() - set(named)
  assert 'plugins/agreemnt_gone.py' in named
  assert not os.path.isfile(os.path.join(REPO_ROOT, 'plugins', 'agreemnt_gone.py'))
  assert len(named_modules(text)) >= len(modules_on_disk())  # the real page names them all
