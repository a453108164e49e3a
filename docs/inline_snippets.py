r"""Copies tested code into the docs pages, so a code host shows it too.

    python -m docs.inline_snippets            # from the repository root

A page shows a file (or one section of it) from the repository between two
marker comments; everything between them is generated from the file:

    <!-- snippet: tests/fixtures/my_project/models.py:scale -->
    From `tests/fixtures/my_project/models.py`, section `scale`:

    ```python
    class Scale(keras.layers.Layer):
      ...
    ```
    <!-- /snippet -->

A section is marked in its file as pymdownx.snippets marks one:
`# --8<-- [start:scale]` ... `# --8<-- [end:scale]`; the lines between them,
without the markers, are the section. A whole file is shown without any
section marker lines. The fence's language comes from the file's extension
(`LANGUAGES`).

To add a sample to a page, write the marker pair with nothing between them,
or a fenced block of pymdownx.snippets include lines
(`--8<-- "path"`, `--8<-- "path:section"`, one per line: each becomes a
marker pair), and run the command. `tests/test_docs_snippets.py` fails when a
page's copy differs from its file, naming the page and this command.
"""

from __future__ import annotations

import glob
import os
import re
import sys

COMMAND = 'python -m docs.inline_snippets'
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

LANGUAGES = {'.py': 'python', '.gin': 'gin', '.sbatch': 'bash', '.sh': 'sh'}
OPEN = re.compile(r'^<!-- snippet: (?P<source>\S+?) -->$', re.M)
CLOSE = '<!-- /snippet -->'
# pymdownx.snippets' include line and section marker (the forms the pages used).
INCLUDE = re.compile(r'^\s*-+8<-+\s+(["\'])(?P<source>.+?)\1\s*$')
SECTION_MARKER = re.compile(r'^.*?-+8<-+[ \t]+\[[ \t]*(start|end)[ \t]*:[ \t]*([\w-]+)[ \t]*\].*$')
_FENCE = re.compile(r'^(`{3,}|~{3,})(.*)$')


class SnippetError(ValueError):
  """A marker or include that cannot be filled: the page and what is wrong."""


def split_source(source: str) -> tuple[str, str | None]:
  """'path:section' -> (path, section); 'path' -> (path, None)."""
  path, _, section = source.partition(':')
  return path, section or None


def source_text(source: str, *, root: str = REPO_ROOT) -> str:
  """The text a marker of `source` ('path' or 'path:section') shows: the
  file without section marker lines, or the lines of one section; without
  the final newline."""
  path, section = split_source(source)
  full = os.path.join(root, path)
  if not os.path.isfile(full):
    raise SnippetError(f'{path} does not exist')
  with open(full, encoding='utf-8') as f:
    lines = f.read().split('\n')
  if section is None:
    kept = [line for line in lines if not SECTION_MARKER.match(line)]
    return '\n'.join(kept).rstrip('\n')
  markers = [(index, match.group(1)) for index, line in enumerate(lines)
             if (match := SECTION_MARKER.match(line)) and match.group(2) == section]
  if [kind for _, kind in markers] != ['start', 'end']:
    raise SnippetError(f'{path} has no section {section!r} (one [start:{section}] line, then '
                       f'one [end:{section}] line)')
  (start, _), (end, _) = markers
  kept = [line for line in lines[start + 1:end] if not SECTION_MARKER.match(line)]
  return '\n'.join(kept)


def language(source: str) -> str:
  path, _ = split_source(source)
  extension = os.path.splitext(path)[1]
  if extension not in LANGUAGES:
    raise SnippetError(f'{path}: no fence language for {extension!r} files (LANGUAGES)')
  return LANGUAGES[extension]


def region(source: str, *, root: str = REPO_ROOT) -> str:
  """The marker pair of `source` and the generated text between them."""
  path, section = split_source(source)
  text = source_text(source, root=root)
  fence = '`' * max(3, 1 + max((len(run) for run in re.findall(r'`+', text)), default=0))
  caption = f'From `{path}`' + (f', section `{section}`:' if section else ':')
  return (f'<!-- snippet: {source} -->\n{caption}\n\n{fence}{language(source)}\n{text}\n'
          f'{fence}\n{CLOSE}')


def _includes_to_markers(text: str) -> str:
  """Each fenced block made only of include lines -> one empty marker pair per
  include (filled by `inline`)."""
  lines, out, index = text.split('\n'), [], 0
  while index < len(lines):
    fence = _FENCE.match(lines[index])
    if fence:
      end = next((k for k in range(index + 1, len(lines))
                  if lines[k].startswith(fence.group(1)) and not lines[k].strip('`~')), None)
      body = [line for line in lines[index + 1:end] if line.strip()] if end else []
      if body and all(INCLUDE.match(line) for line in body):
        pairs = [f'<!-- snippet: {INCLUDE.match(line).group("source")} -->\n{CLOSE}'
                 for line in body]
        out.append('\n\n'.join(pairs))
        index = end + 1
        continue
      if end is not None:
        out += lines[index:end + 1]
        index = end + 1
        continue
    out.append(lines[index])
    index += 1
  return '\n'.join(out)


def inline(text: str, *, page: str = '<page>', root: str = REPO_ROOT) -> str:
  """`text` (a markdown page) with every snippet region regenerated."""
  text = _includes_to_markers(text)
  out, position = [], 0
  for match in OPEN.finditer(text):
    if match.start() < position:
      continue  # inside a region already replaced (cannot happen in a well-formed page)
    close = text.find(CLOSE, match.end())
    following = OPEN.search(text, match.end())
    if close < 0 or (following and following.start() < close):
      line = text.count('\n', 0, match.start()) + 1
      raise SnippetError(f'{page}:{line}: <!-- snippet: {match.group("source")} --> has no '
                         f'{CLOSE} before the next marker or the end of the page')
    try:
      generated = region(match.group('source'), root=root)
    except SnippetError as error:
      line = text.count('\n', 0, match.start()) + 1
      raise SnippetError(f'{page}:{line}: {error}') from None
    out += [text[position:match.start()], generated]
    position = close + len(CLOSE)
  out.append(text[position:])
  return ''.join(out)


def pages(root: str = REPO_ROOT) -> list[str]:
  """README.md and every docs page, relative to `root`."""
  found = [os.path.join(root, 'README.md')]
  found += sorted(glob.glob(os.path.join(root, 'docs', '**', '*.md'), recursive=True))
  return [os.path.relpath(p, root) for p in found if os.path.isfile(p)]


def stale_pages(root: str = REPO_ROOT) -> list[str]:
  """The pages whose snippets differ from what `inline` makes of them."""
  stale = []
  for page in pages(root):
    with open(os.path.join(root, page), encoding='utf-8') as f:
      text = f.read()
    if inline(text, page=page, root=root) != text:
      stale.append(page)
  return stale


def main(root: str = REPO_ROOT) -> int:
  for page in pages(root):
    path = os.path.join(root, page)
    with open(path, encoding='utf-8') as f:
      text = f.read()
    try:
      new = inline(text, page=page, root=root)
    except SnippetError as error:
      print(f'inline_snippets: {error}', file=sys.stderr)
      return 2
    if new != text:
      with open(path, 'w', encoding='utf-8') as f:
        f.write(new)
      print(f'updated {page}')
  return 0


if __name__ == '__main__':
  sys.exit(main())
