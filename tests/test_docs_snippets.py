"""The code samples copied into the docs are their files, byte for byte.

Pages show tested files (tests/fixtures/my_project/*, examples/slurm/...)
between `<!-- snippet: path[:section] -->` and `<!-- /snippet -->`, copied
there by `python -m docs.inline_snippets`, so a code host shows the code
(pymdownx.snippets' include lines show as they are written there). These
tests read each copy out of the page and the file (or the section between its
`--8<-- [start:name]` / `[end:name]` lines) on their own, and compare the two;
an edit to the file without regenerating fails naming the page and the command.
The positive controls edit a file in a copy of the repository and check that
the comparison and the generator's own check then fail, and that the command
brings the page back.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import pytest

from docs import inline_snippets
from tests.conftest import REPO_ROOT

MARKED = re.compile(r'^<!-- snippet: (\S+?) -->\n(.*?)^<!-- /snippet -->$', re.M | re.S)


def read(root, path):
  with open(os.path.join(root, path), encoding='utf-8') as f:
    return f.read()


def copies(root=REPO_ROOT) -> list[tuple[str, int, str, str]]:
  """(page, line, source, the fenced code between the markers) of every copy."""
  found = []
  for page in inline_snippets.pages(root):
    text = read(root, page)
    for match in MARKED.finditer(text):
      fenced = re.search(r'^(`{3,})\w*\n(.*)\n\1$', match.group(2), re.M | re.S)
      body = fenced.group(2) if fenced else None
      found.append((page, text.count('\n', 0, match.start()) + 1, match.group(1), body))
  return found


def file_part(root, source: str) -> str:
  """The file's text (without the final newline), or the lines between its
  `[start:name]` and `[end:name]` marker lines: read here independently of
  the generator."""
  path, _, section = source.partition(':')
  lines = read(root, path).rstrip('\n').split('\n')
  if not section:
    return '\n'.join(line for line in lines if '--8<-- [' not in line)
  start = lines.index(next(line for line in lines if f'--8<-- [start:{section}]' in line))
  end = lines.index(next(line for line in lines if f'--8<-- [end:{section}]' in line))
  return '\n'.join(lines[start + 1:end])


def mismatches(root=REPO_ROOT) -> list[str]:
  return [f'{page}:{line}: the copy of {source} differs from the file; regenerate it with: '
          f'{inline_snippets.COMMAND}'
          for page, line, source, body in copies(root) if body != file_part(root, source)]


COPIES = copies()


def test_the_pages_show_the_tested_code():
  shown = {(page, source) for page, _, source, _ in COPIES}
  assert {('docs/own-model.md', 'tests/fixtures/my_project/layers.py'),
          ('docs/own-model.md', 'tests/fixtures/my_project/models.py:scale'),
          ('docs/own-model.md', 'tests/fixtures/my_project/keras.gin'),
          ('docs/cluster.md', 'examples/slurm/train.sbatch')} <= shown, shown


@pytest.mark.parametrize('page, line, source, body', COPIES,
                         ids=[f'{page}:{line}:{source}' for page, line, source, _ in COPIES])
def test_every_copy_is_its_file(page, line, source, body):
  assert body is not None, f'{page}:{line}: no fenced code between the markers of {source}'
  assert body == file_part(REPO_ROOT, source), (
      f'{page}:{line}: the copy of {source} differs from the file; regenerate it with: '
      f'{inline_snippets.COMMAND}')


def test_no_page_has_an_include_line_left():
  """mkdocs no longer expands pymdownx.snippets' `--8<-- "path"` lines (and a
  code host never did): a page must hold the copy itself."""
  left = [f'{page}:{number}: {line.strip()}' for page in inline_snippets.pages()
          for number, line in enumerate(read(REPO_ROOT, page).split('\n'), 1)
          if inline_snippets.INCLUDE.match(line)]
  assert not left, f'include lines left (run {inline_snippets.COMMAND}): {left}'


def test_the_pages_are_up_to_date():
  stale = inline_snippets.stale_pages()
  assert not stale, f'{stale} differ from their snippets; regenerate with: ' \
      f'{inline_snippets.COMMAND}'


# -- positive controls ---------------------------------------------------------
@pytest.fixture
def repo_copy(tmp_path):
  """The pages and the files they copy from, under tmp_path."""
  root = tmp_path / 'repo'
  root.mkdir()
  shutil.copy(os.path.join(REPO_ROOT, 'README.md'), root / 'README.md')
  shutil.copytree(os.path.join(REPO_ROOT, 'docs'), root / 'docs',
                  ignore=shutil.ignore_patterns('__pycache__', '*.png', 'img'))
  for source in ('tests/fixtures/my_project', 'examples/slurm'):
    shutil.copytree(os.path.join(REPO_ROOT, source), root / source,
                    ignore=shutil.ignore_patterns('__pycache__'))
  assert mismatches(str(root)) == [] and inline_snippets.stale_pages(str(root)) == []
  return root


def test_an_edited_section_fails_naming_the_page_and_the_command(repo_copy):
  models = repo_copy / 'tests' / 'fixtures' / 'my_project' / 'models.py'
  text = models.read_text()
  assert "initializer='ones'" in text
  models.write_text(text.replace("initializer='ones'", "initializer='zeros'", 1))
  found = mismatches(str(repo_copy))
  # the section `scale` changed, on both pages that show it; `imports` did not
  assert [m.split(': the copy of ')[1].split(' ')[0] for m in found] == [
      'tests/fixtures/my_project/models.py:scale'] * 2, found
  assert {m.split(':')[0] for m in found} == {'docs/own-model.md', 'docs/reference/api.md'}
  assert all(inline_snippets.COMMAND in m for m in found)
  assert set(inline_snippets.stale_pages(str(repo_copy))) == {'docs/own-model.md',
                                                                'docs/reference/api.md'}
  # the command brings the pages back in line with the file
  assert inline_snippets.main(str(repo_copy)) == 0
  assert mismatches(str(repo_copy)) == [] and inline_snippets.stale_pages(str(repo_copy)) == []
  assert "initializer='zeros'" in (repo_copy / 'docs' / 'own-model.md').read_text()


def test_an_edited_whole_file_fails(repo_copy):
  script = repo_copy / 'examples' / 'slurm' / 'train.sbatch'
  script.write_text(script.read_text().replace('--nodes=2', '--nodes=3'))
  assert [m.split(':')[0] for m in mismatches(str(repo_copy))] == ['docs/cluster.md']


def test_include_lines_become_copies_and_bad_sources_are_named(repo_copy):
  page = repo_copy / 'docs' / 'new.md'
  page.write_text('Intro.\n\n```python\n--8<-- "tests/fixtures/my_project/models.py:imports"\n'
                  '```\n\nEnd.\n')
  assert inline_snippets.main(str(repo_copy)) == 0
  text = page.read_text()
  assert '--8<--' not in text and text.startswith('Intro.\n\n<!-- snippet: ')
  assert 'keras = import_keras()\n```\n<!-- /snippet -->\n\nEnd.\n' in text
  assert mismatches(str(repo_copy)) == []
  for source, named in (('tests/fixtures/my_project/nope.py', 'nope.py does not exist'),
                        ('tests/fixtures/my_project/models.py:nope', "no section 'nope'")):
    page.write_text(f'Intro.\n\n<!-- snippet: {source} -->\n<!-- /snippet -->\n')
    with pytest.raises(inline_snippets.SnippetError, match=named) as error:
      inline_snippets.inline(page.read_text(), page='docs/new.md', root=str(repo_copy))
    assert str(error.value).startswith('docs/new.md:3: ')


def test_the_command_runs_from_the_repository_root(repo_copy):
  """`python -m docs.inline_snippets` as the pages and the failures say: here on
  an up-to-date copy, where it changes nothing."""
  shutil.copy(os.path.join(REPO_ROOT, 'docs', 'inline_snippets.py'),
              repo_copy / 'docs' / 'inline_snippets.py')
  before = {p: read(str(repo_copy), p) for p in inline_snippets.pages(str(repo_copy))}
  done = subprocess.run([sys.executable, *inline_snippets.COMMAND.split()[1:]], cwd=repo_copy,
                        capture_output=True, text=True, timeout=60,
                        env={k: v for k, v in os.environ.items() if k != 'PYTHONPATH'})
  assert done.returncode == 0, done.stderr
  assert {p: read(str(repo_copy), p) for p in before} == before
