"""Every message docs/troubleshooting.md quotes is one meshgin's code can print.

The page quotes messages in ```text blocks, one message line per line. The
parts that vary (names, numbers, paths) are written as `<...>` placeholders
or `…`. Each quoted line is checked against the string literals of
layout_core/, plugins/ and launch/, read with `ast` (nothing is imported, so
no TensorFlow):

1. Every literal becomes *parts*: a plain string is one part; an f-string is
   cut at its `{fields}`; every part is also cut at newlines and at `%s` /
   `{name}` format fields (the uncut string stays a part too). Docstrings
   are left out. A string that is itself Python code (a child process's
   program) is read for its own literals.
2. A quoted line is cut at its placeholders into fixed segments. A segment
   passes when it lies inside one part, or when it is a chain of parts
   joined where the code joins them, at a field or a `+`: the first piece
   ends a part, the last begins one, any between is a whole part. That is
   how `ConfigError(what, where=..., fix=...)` composes its message, how a
   `+` joins strings, and how a field's value (another literal) fills it.
   Joined pieces of letters or digits must be at least 3 characters long,
   so a chain of one-letter strings cannot spell any word.
3. A `<...>` placeholder stands where the code has a field: the segment
   after it must begin where a part begins, the one before it end where a
   part ends (`Clients <i> of` fails where the code says `Client {i} of`).
   A `…` may leave out literal text too, so it sets no such bound.

    check_line("Training diverged: train loss is <nan> at step <N>")  # []
    check_line("Training diverged: train loss was <nan> at step <N>")
    # -> ['Training diverged: train loss was ']

A changed word can still pass where the new text is itself a whole literal
at a join point (`the file` for `a file`); over the page's quotes, about 98%
of single-word changes fail.

The positive controls change one word of a quote and check that the line
then fails, naming it; every quoted line of the page is also checked to fail
once its longest word is garbled, so no line passes without being read.

Structure: every entry (a `###` heading) has a quoted message, a
**Cause.** and a **Fix.** paragraph, and the page's contents table links
every entry.
"""

from __future__ import annotations

import ast
import bisect
import functools
import os
import re
import unicodedata

import pytest

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGE = os.path.join(REPO_ROOT, 'docs', 'troubleshooting.md')
SOURCE_DIRS = ('layout_core', 'plugins', 'launch')
# A varying part of a quoted message: `<what it is>` or an ellipsis.
PLACEHOLDER = re.compile(r'<[^<>\n]*>|…')
# Where a plain string is cut as well as kept whole: %-style and str.format
# fields (a dict literal such as {'data': 8} is not a field), and newlines.
FORMAT_FIELD = re.compile(
    r'%(?:\(\w+\))?[-#0 +]*(?:\d+|\*)?(?:\.\d+)?[diouxXeEfFgGcrsa]'
    r'|\{\w*(?:\.\w+|\[\w+\])*(?:![rsa])?(?::[^{}\'"]*)?\}'
    r'|\n')
MIN_JOINED_PIECE = 3  # characters, for a joined piece holding a letter or digit


# -- the code's strings --------------------------------------------------------
def _docstring_nodes(tree: ast.AST) -> set[int]:
  """ids of docstrings and of other bare string statements (not messages)."""
  found = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(
        node.value.value, str):
      found.add(id(node.value))
  return found


def _cut(text: str) -> list[str]:
  """`text` itself, and its pieces between format fields and newlines."""
  pieces = [piece for piece in FORMAT_FIELD.split(text) if piece]
  return [text] if pieces == [text] else [text] + pieces


def _is_program(text: str) -> ast.Module | None:
  """The syntax tree of a string that is a Python program (several lines of
  statements), else None."""
  if text.count('\n') < 2:
    return None
  try:
    tree = ast.parse(text)
  except (SyntaxError, ValueError):
    return None
  statements = [s for s in tree.body if not isinstance(s, ast.Expr)]
  return tree if statements else None


def parts_of_tree(tree: ast.AST) -> list[str]:
  """Every literal part of the strings in `tree` (see the module docstring)."""
  skip = _docstring_nodes(tree)
  in_fstring = set()
  parts: list[str] = []
  for node in ast.walk(tree):
    if isinstance(node, ast.JoinedStr):
      run = ''
      for value in node.values:
        in_fstring.add(id(value))
        if isinstance(value, ast.Constant):
          run += str(value.value)
        else:  # a {field}: it ends the literal run
          parts += _cut(run) if run else []
          run = ''
      parts += _cut(run) if run else []
    elif (isinstance(node, ast.Constant) and isinstance(node.value, str)
          and id(node) not in skip and id(node) not in in_fstring and node.value):
      parts += _cut(node.value)
      program = _is_program(node.value)
      if program is not None:
        parts += parts_of_tree(program)
  return parts


def source_files() -> list[str]:
  found = []
  for directory in SOURCE_DIRS:
    for root, _, names in os.walk(os.path.join(REPO_ROOT, directory)):
      found += [os.path.join(root, n) for n in sorted(names) if n.endswith('.py')]
  return sorted(found)


class Parts:
  """The code's string parts, indexed for the checks `covers` makes."""

  def __init__(self, parts):
    self.whole = set(parts)
    self.forward = sorted(self.whole)
    self.backward = sorted(p[::-1] for p in self.whole)
    self.text = '\0'.join(self.forward)  # substring search; \0 is in no message

  def contains(self, piece: str) -> bool:
    return piece in self.text

  def _begins(self, ordered: list[str], piece: str) -> bool:
    at = bisect.bisect_left(ordered, piece)
    return at < len(ordered) and ordered[at].startswith(piece)

  def begins_a_part(self, piece: str) -> bool:
    return self._begins(self.forward, piece)

  def ends_a_part(self, piece: str) -> bool:
    return self._begins(self.backward, piece[::-1])


@functools.lru_cache(maxsize=None)
def code_parts() -> Parts:
  parts = []
  for path in source_files():
    with open(path, encoding='utf-8') as f:
      parts += parts_of_tree(ast.parse(f.read(), filename=path))
  return Parts(parts)


# -- matching ------------------------------------------------------------------
def _joinable(piece: str) -> bool:
  return len(piece) >= MIN_JOINED_PIECE or not any(c.isalnum() for c in piece)


def _fits(parts: Parts, piece: str, *, begins: bool, ends: bool) -> bool:
  """Whether `piece` lies in one part: at its start, its end, both or anywhere."""
  if begins and ends:
    return piece in parts.whole
  if begins:
    return parts.begins_a_part(piece)
  if ends:
    return parts.ends_a_part(piece)
  return parts.contains(piece)


def covers(parts: Parts, segment: str, *, after_field: bool = False,
           before_field: bool = False) -> bool:
  """Whether the fixed `segment` of a quote is one part's text, or parts
  joined at fields (see the module docstring). `after_field` /
  `before_field`: a placeholder is next to it, so that end of the segment
  must be where a part begins / ends, as a field's value does."""
  end = len(segment)
  if _fits(parts, segment, begins=after_field, ends=before_field):
    return True
  reached = [False] * (end + 1)
  reached[0] = True
  for start in range(end):
    if not reached[start]:
      continue
    for stop in range(start + 1, end + 1):
      piece = segment[start:stop]
      if (start == 0 and stop == end) or not _joinable(piece):
        continue  # the whole segment in one piece was tried above
      if _fits(parts, piece, begins=start > 0 or after_field,
               ends=stop < end or before_field):
        if stop == end:
          return True
        reached[stop] = True
  return False


def segments(line: str) -> list[tuple[str, bool, bool]]:
  """The fixed text of a quoted line between its placeholders: (text, whether
  a `<...>` comes before it, whether one comes after it). Next to a `…`
  (text left out, which may be literal text) the segment is free."""
  line = line.strip()
  found, start, field_before = [], 0, False
  for match in list(PLACEHOLDER.finditer(line)) + [None]:
    stop = match.start() if match else len(line)
    field_after = match is not None and match.group() != '…'
    text = line[start:stop]
    if text.strip():
      found.append((text, field_before, field_after))
    if match:
      start, field_before = match.end(), field_after
  return found


def check_line(line: str, parts: Parts | None = None) -> list[str]:
  """The segments of `line` that no string of the code accounts for."""
  parts = parts or code_parts()
  return [text for text, after, before in segments(line)
          if not covers(parts, text, after_field=after, before_field=before)]


# -- the page ------------------------------------------------------------------
def read_page() -> str:
  with open(PAGE, encoding='utf-8') as f:
    return f.read()


def fenced_blocks(text: str) -> list[tuple[int, str, list[str]]]:
  """(line number, language, body lines) of every ``` block."""
  blocks, current = [], None
  for number, line in enumerate(text.splitlines(), 1):
    fence = re.match(r'\s*```\s*(\S*)', line)
    if fence and current is None:
      current = (number, fence.group(1), [])
    elif fence:
      blocks.append(current)
      current = None
    elif current is not None:
      current[2].append(line)
  assert current is None, f'an unclosed ``` block at line {current[0]}'
  return blocks


def quoted_lines(text: str) -> list[tuple[int, str]]:
  """(page line, text) of every non-empty line of every ```text block."""
  return [(number + offset, line) for number, language, body in fenced_blocks(text)
          if language == 'text' for offset, line in enumerate(body, 1) if line.strip()]


def entries(text: str) -> list[tuple[str, str]]:
  """(heading, body) of every `###` entry; a body ends at the next heading."""
  found = []
  for match in re.finditer(r'^### ([^\n]+)\n(.*?)(?=^#{1,3} |\Z)', text, re.M | re.S):
    found.append((match.group(1).strip(), match.group(2)))
  return found


def slug(heading: str) -> str:
  """The anchor mkdocs (Python-Markdown's toc) gives a heading."""
  text = re.sub(r'`([^`]*)`', r'\1', heading)
  text = unicodedata.normalize('NFKD', text).encode('ascii', 'ignore').decode('ascii')
  text = re.sub(r'[^\w\s-]', '', text).strip().lower()
  return re.sub(r'[-\s]+', '-', text)


def garbled(line: str) -> str | None:
  """`line` with the longest word of its fixed text turned into nonsense
  (None when it has no word to garble)."""
  words = [w for s, _, _ in segments(line) for w in re.findall(r'[A-Za-z]{3,}', s)]
  if not words:
    return None
  word = max(words, key=len)
  fixed = [m for m in re.finditer(rf'\b{word}\b', line)
           if not any(p.start() <= m.start() < p.end() for p in PLACEHOLDER.finditer(line))]
  at = fixed[0].start() if fixed else line.index(word)
  return line[:at] + 'zq' + word[::-1] + line[at + len(word):]


# -- the tests -----------------------------------------------------------------
QUOTES = quoted_lines(read_page())


def test_the_page_quotes_messages():
  assert len(QUOTES) >= 30, f'only {len(QUOTES)} quoted lines on {PAGE}'
  assert len(code_parts().whole) > 1000  # the sources were read


@pytest.mark.parametrize('number,line', QUOTES, ids=[f'line{n}' for n, _ in QUOTES])
def test_every_quoted_message_is_in_the_code(number, line):
  missing = check_line(line)
  assert not missing, (f'docs/troubleshooting.md:{number}: {line!r}\n'
                       f'no string in {", ".join(SOURCE_DIRS)} gives: {missing}')


def test_a_garbled_word_fails_every_quoted_line():
  passed = [(number, changed) for number, line in QUOTES
            if (changed := garbled(line)) and not check_line(changed)]
  assert not passed, f'these lines pass even with a word garbled: {passed}'


QUOTE_OF_THE_WATCHDOG = ('Cluster error: client <k> gave up after <seconds> s waiting for '
                         'the other clients of <cluster list> to join (not listening: '
                         '<client j (host:port)>). Start every client with the same '
                         '--cluster list, or raise --cluster_init_timeout.')


def test_a_real_message_passes():
  assert check_line(QUOTE_OF_THE_WATCHDOG) == []   # a child process's program
  assert check_line("Configuration error: train.batch_size=<B> does not split over mesh "
                    "axis '<axis>' of size <n>. Where: train.batch_size / mesh.shape. "
                    "Fix: use a multiple of <n> (e.g. <B'>).") == []  # ConfigError's parts
  assert check_line("<dir> is in use by another run: pid <P> on <HOST>, started <T> "
                    "(launch.train): <command>") == []


@pytest.mark.parametrize('line,word,changed', [
    (QUOTE_OF_THE_WATCHDOG, 'gave up after', 'gives up after'),
    (QUOTE_OF_THE_WATCHDOG, 'not listening', 'not answering'),
    ("Fix: use a multiple of <n> (e.g. <B'>).", 'use a multiple', 'use any multiple'),
    ("Training diverged: <what> is <value> at step <N>; lower optimizer.learning_rate, "
     "clip harder or check the data", 'clip harder', 'clip softer'),
    ('Client <i> of <N> failed: <error>', 'Client <i>', 'Clients <i>'),
], ids=['words in an f-string', 'a string joined with +', "a ConfigError's fix",
        'a message and its prefix', 'a word next to a field'])
def test_a_changed_word_fails_naming_the_message(line, word, changed):
  assert check_line(line) == []
  wrong = line.replace(word, changed)
  missing = check_line(wrong)
  assert missing and any(changed.split()[0] in s or changed.split()[-1] in s
                         for s in missing), missing


def test_parts_are_cut_where_the_code_joins_strings():
  tree = ast.parse('"""Doc: not a message."""\n'
                   'x = f"lost {who}, stop"\n'
                   'y = "took %s over" + name\n'
                   'z = "line one\\nline two"\n')
  parts = Parts(parts_of_tree(tree))
  assert 'Doc: not a message.' not in parts.whole
  assert {'lost ', ', stop', 'took ', ' over', 'line one', 'line two'} <= parts.whole
  assert covers(parts, 'lost took ')          # a field filled by another string
  assert covers(parts, 'line two')
  assert not covers(parts, 'lostt')
  assert not covers(parts, 'lost over')       # 'lost' ends no part


def test_every_entry_has_a_message_a_cause_and_a_fix():
  found = entries(read_page())
  assert len(found) >= 10, found
  for heading, body in found:
    blocks = [b for b in fenced_blocks(body) if b[1] == 'text']
    assert blocks, f'entry {heading!r} quotes no message (a ```text block)'
    assert re.search(r'^\*\*Cause\.\*\* \S', body, re.M), f'entry {heading!r} has no **Cause.**'
    assert re.search(r'^\*\*Fix\.\*\* \S', body, re.M), f'entry {heading!r} has no **Fix.**'


def test_the_contents_table_links_every_entry():
  text = read_page()
  contents = text.split('\n## ', 2)[1]  # the first section: the contents table
  linked = set(re.findall(r'\]\(#([^)]+)\)', contents))
  anchors = {slug(heading) for heading, _ in entries(text)}
  assert anchors - linked == set(), f'entries missing from the contents: {anchors - linked}'
  assert linked - anchors == set(), f'contents links with no entry: {linked - anchors}'


def contents_fragments(text: str) -> list[str]:
  """The `code` fragments of the contents table's first column, but for the
  names of entry points (`launch.sweep`)."""
  contents = text.split('\n## ', 2)[1]
  rows = re.findall(r'^\| (.*?) \| [^|]* \| [^|]* \|$', contents, re.M)
  return [fragment for row in rows for fragment in re.findall(r'`([^`]+)`', row)
          if not re.fullmatch(r'launch\.\w+', fragment)]


def test_the_contents_table_quotes_the_code_too():
  fragments = contents_fragments(read_page())
  assert len(fragments) >= 30, fragments
  wrong = {fragment: missing for fragment in fragments if (missing := check_line(fragment))}
  assert not wrong, f'contents fragments that no string of the code gives: {wrong}'


def test_exit_statuses_are_linked_not_copied():
  text = read_page()
  assert 'configuration.md#exit-statuses-and-run_statusjson' in text
  assert '| `143` |' not in text  # the table lives in configuration.md
