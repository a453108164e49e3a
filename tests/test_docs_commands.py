"""Every shell command and gin block in the docs runs as written.

Collects every fenced code block (``` or ~~~, with an info string; indented
code is ignored) of README.md and docs/**/*.md whose language is sh, bash,
shell, console or gin. Shell blocks are split into commands (backslash
continuations joined; split on &&, ||, ;, |, parentheses and newlines; leading
`FOO=1` assignments and `$ ` prompts dropped). For a meshgin entry point
(`[path/]python[3] -m launch.X ...`):

1. launch/X.py exists;
2. every --flag (--noflag for booleans, --flag=value, --flag value) is one the
   entry point defines. The entry points define some flags of the same name
   (--model_dir), so each is imported in a fresh process that lists its
   absl.flags.FLAGS (absl's own --helpfull, --verbosity, ... included);
3. every --gin_file exists (the repository root, the current directory and
   --gin_search_paths are searched, as launch.* does); a missing one that
   is clearly a placeholder ('<', '...', 'my_', '$') is skipped and counted;
4. every --gin_bindings parses as gin after plugins.configurables is
   imported; for launch.train and launch.inspect with real gin files, the
   files plus bindings build the typed plan as launch.inspect's start-up does
   (plugins.gin_setup.parsed_config, then plugins.plan.make_plan: nothing is
   trained, no device is touched); for launch.sweep they parse.

`python -m pkg.mod` for another package of this repository (tests.run,
examples.classifier.write_data) and `python path/to/script.py` must name an
existing module or script. Every ```gin block parses (includes and imports
resolved from the repository root and the --gin_search_paths the same page
uses); a block with '...' or '<' in it is a placeholder and skipped.
"""

from __future__ import annotations

import dataclasses
import functools
import glob
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile

import gin
import pytest

from plugins import gin_setup

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHELL_LANGUAGES = {'sh', 'bash', 'shell', 'console', 'zsh'}
PLAN_ENTRY_POINTS = {'train', 'inspect'}
_FENCE = re.compile(r'^( {0,3})(`{3,}|~{3,})(.*)$')
_ASSIGNMENT = re.compile(r'^[A-Za-z_][A-Za-z0-9_]*=')
_PYTHON = re.compile(r'^python(\d+(\.\d+)?)?$')
_SEPARATORS = {'&&', '||', ';', '|', '&', '(', ')', ';;', '|&'}
_REDIRECTIONS = {'>', '>>', '<', '2>', '&>', '>&', '<<', '<<<'}
_PYTHON_OPTIONS_WITH_VALUE = {'-W', '-X', '-c', '-Q'}


def is_placeholder(text: str) -> bool:
  return any(mark in text for mark in ('<', '...', 'my_', '$'))


# -- reading the markdown ------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Block:
  line: int  # of the opening fence, 1-based
  language: str
  body: str


def fenced_blocks(text: str) -> list[Block]:
  """CommonMark fenced code blocks: an opening fence of three or more ` or ~
  indented at most three spaces, closed by a fence of the same character at
  least as long (or the end of the text). Indented code is not a fence."""
  blocks = []
  lines = text.split('\n')
  index = 0
  while index < len(lines):
    match = _FENCE.match(lines[index])
    if not match or (match.group(2)[0] == '`' and '`' in match.group(3)):
      index += 1
      continue
    indent, fence, info = len(match.group(1)), match.group(2), match.group(3).strip()
    words = info.split()
    language = words[0].strip('{}').lstrip('.').lower() if words else ''
    body = []
    end = index + 1
    while end < len(lines):
      close = _FENCE.match(lines[end])
      if (close and close.group(2)[0] == fence[0] and len(close.group(2)) >= len(fence)
          and not close.group(3).strip()):
        break
      line = lines[end]
      body.append(line[min(indent, len(line) - len(line.lstrip(' '))):])
      end += 1
    blocks.append(Block(line=index + 1, language=language, body='\n'.join(body)))
    index = end + 1
  return blocks


@dataclasses.dataclass(frozen=True)
class Command:
  line: int  # in the markdown file
  words: tuple[str, ...]


def _logical_lines(block: Block):
  """(line, text) of each command line: continuations joined; in a console
  block only the lines after a `$ ` prompt."""
  console = block.language == 'console'
  pending, start = '', 0
  for offset, raw in enumerate(block.body.split('\n')):
    line_number = block.line + 1 + offset
    text = raw.strip()
    if not pending:
      if console:
        if not text.startswith('$'):
          continue
        text = text[1:].strip()
      elif text.startswith('$ '):
        text = text[2:].strip()
      start = line_number
    elif console and text.startswith('> '):
      text = text[2:]
    if text.endswith('\\'):
      pending += text[:-1] + ' '
      continue
    yield start, pending + text
    pending = ''
  if pending:
    yield start, pending


def shell_commands(block: Block) -> list[Command]:
  """The simple commands of a shell block, without env assignments."""
  commands = []
  for line, text in _logical_lines(block):
    lexer = shlex.shlex(text, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    lexer.commenters = '#'
    try:
      tokens = list(lexer)
    except ValueError:  # an unclosed quote: keep what can be split
      tokens = text.split()
    words: list[str] = []
    skip_next = False
    for token in tokens + [';']:
      if skip_next:
        skip_next = False
      elif token in _SEPARATORS:
        while words and _ASSIGNMENT.match(words[0]):
          words.pop(0)
        if words:
          commands.append(Command(line, tuple(words)))
        words = []
      elif token in _REDIRECTIONS or re.fullmatch(r'\d?[<>]{1,2}&?', token):
        skip_next = True
      else:
        words.append(token)
  return commands


# -- what the entry points accept ----------------------------------------------
_LIST_FLAGS = r'''
import importlib, json, sys
importlib.import_module(sys.argv[1])
from absl import app, flags
app.define_help_flags()  # --help, --helpfull, ...: app.run defines them
print('FLAGS ' + json.dumps({name: flags.FLAGS[name].boolean for name in flags.FLAGS}))
'''


@functools.lru_cache(maxsize=None)
def entry_point_flags(module: str) -> dict[str, bool]:
  """{flag name: is boolean} of `python -m module` (imported in a fresh
  process: the launchers define flags of the same name)."""
  done = subprocess.run([sys.executable, '-c', _LIST_FLAGS, module], cwd=REPO_ROOT,
                        capture_output=True, text=True, timeout=300,
                        env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL='3'))
  if done.returncode != 0 or 'FLAGS ' not in done.stdout:
    raise RuntimeError(f'importing {module} failed:\n{done.stderr[-2000:]}')
  return json.loads(done.stdout.split('FLAGS ', 1)[1])


def _error_text(error: BaseException) -> str:
  return f'{type(error).__name__}: ' + ' '.join(str(error).split())


@functools.lru_cache(maxsize=None)
def config_problem(files: tuple[str, ...], bindings: tuple[str, ...],
                   search_paths: tuple[str, ...], build_plan: bool) -> str | None:
  """What is wrong with these gin files and bindings (None: nothing): they
  parse, and with `build_plan` the typed plan builds (launch.inspect's and
  launch.train's start-up checks; nothing trains)."""
  from plugins import gin_setup, plan  # pylint: disable=import-outside-toplevel
  cwd = os.getcwd()
  os.chdir(REPO_ROOT)  # launch.* run from the repository root
  try:
    with gin_setup.parsed_config(files=files, bindings=bindings, search_paths=search_paths):
      if build_plan:
        plan.make_plan()
  except Exception as error:  # pylint: disable=broad-except
    return _error_text(error)
  finally:
    os.chdir(cwd)
    gin.clear_config()
  return None


@functools.lru_cache(maxsize=None)
def binding_problem(binding: str) -> str | None:
  """Whether one --gin_bindings value parses on its own (configurables and
  parameters known)."""
  from plugins import configurables  # noqa: F401  pylint: disable=g-import-not-at-top
  gin.clear_config()
  try:
    with gin.unlock_config():
      gin.parse_config(binding, skip_unknown=False)
  except Exception as error:  # pylint: disable=broad-except
    return _error_text(error)
  finally:
    gin.clear_config()
  return None


# -- checking ------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Page:
  """What a page's commands tell about the others: the --gin_search_paths
  they use (gin blocks resolve imports and includes there too) and the
  directories they write data to (--output_dir, --out_dir: a config reading
  data there needs that command run first)."""
  search_paths: tuple[str, ...] = ()
  data_dirs: tuple[str, ...] = ()


_DATA_MISSING = re.compile(r"no file matches the \w+ pattern '([^']*)'")


@dataclasses.dataclass
class Report:
  problems: list[str] = dataclasses.field(default_factory=list)
  skipped: list[str] = dataclasses.field(default_factory=list)  # placeholders
  entry_point_commands: int = 0  # launch.* commands checked

  def extend(self, other: 'Report') -> None:
    self.problems += other.problems
    self.skipped += other.skipped
    self.entry_point_commands += other.entry_point_commands


def _python_target(words: tuple[str, ...]):
  """('module', name, args) / ('script', path, args) / None for a command."""
  if not words or not _PYTHON.match(os.path.basename(words[0])):
    return None
  index = 1
  while index < len(words):
    word = words[index]
    if word == '-m' and index + 1 < len(words):
      return 'module', words[index + 1], list(words[index + 2:])
    if word.startswith('-m') and len(word) > 2:
      return 'module', word[2:], list(words[index + 1:])
    if word in _PYTHON_OPTIONS_WITH_VALUE:
      if word == '-c':
        return None
      index += 2
      continue
    if word.startswith('-'):
      index += 1
      continue
    return 'script', word, list(words[index + 1:])
  return None


def _module_exists(module: str) -> bool:
  base = os.path.join(REPO_ROOT, *module.split('.'))
  return os.path.isfile(base + '.py') or os.path.isfile(os.path.join(base, '__main__.py'))


# Flags an entry point refuses to run without (exit 2); a command shortened
# with `...` may leave them out. A tuple of names: any one of them will do.
REQUIRED_FLAGS = {'launch.train': ('model_dir',), 'launch.sweep': ('model_dir',),
                  'launch.eval': (('model_dir', 'checkpoint'),),
                  'launch.decode': (('model_dir', 'checkpoint'),)}


def check_entry_point(module: str, args: list[str], where: str, page: Page = Page()) -> Report:
  """Checks one `python -m launch.X args...` (see the module doc)."""
  report = Report(entry_point_commands=1)
  name = module.split('.', 1)[1]
  if not os.path.isfile(os.path.join(REPO_ROOT, 'launch', f'{name}.py')):
    report.problems.append(f'{where}: launch/{name}.py does not exist (python -m {module})')
    return report
  defined = entry_point_flags(module)
  files, bindings, search_paths, given = [], [], [], set()
  index = 0
  while index < len(args):
    word = args[index]
    index += 1
    if word == '--':  # absl stops here; local_cluster passes the rest to launch.train
      if name == 'local_cluster':
        report.extend(check_entry_point('launch.train', args[index:], where, page))
        report.entry_point_commands -= 1
      break
    if not word.startswith('-') or word == '-':
      continue
    flag, has_value, value = word.lstrip('-').partition('=')
    if flag in defined:
      if not has_value and not defined[flag]:
        if index < len(args):
          value = args[index]
          index += 1
        else:
          report.problems.append(f'{where}: --{flag} of {module} needs a value')
          continue
    elif flag.startswith('no') and defined.get(flag[2:]) is True and not has_value:
      continue
    else:
      report.problems.append(f'{where}: {module} has no flag --{flag}')
      continue
    given.add(flag)
    if flag == 'gin_file':
      files.append(value)
    elif flag == 'gin_bindings':
      bindings.append(value)
    elif flag == 'gin_search_paths':
      search_paths += [p for p in value.split(',') if p]
  abbreviated = '...' in args or given & {'help', 'helpfull', 'helpshort'}
  for flag in REQUIRED_FLAGS.get(module, ()):
    choices = (flag,) if isinstance(flag, str) else flag
    if not given & set(choices) and not abbreviated:
      report.problems.append(f'{where}: {module} needs --{" or --".join(choices)} '
                             '(it has no default)')
  real_files = []
  for path in files:
    if gin_setup.find_gin_file(path, [REPO_ROOT] + [os.path.join(REPO_ROOT, p)
                                                    for p in search_paths]):
      real_files.append(path)
    elif is_placeholder(path):
      report.skipped.append(f'{where}: placeholder --gin_file={path}')
    else:
      report.problems.append(f'{where}: --gin_file={path} does not exist')
  binding_errors = [(b, binding_problem(b)) for b in bindings]
  report.problems += [f'{where}: --gin_bindings={b!r} does not parse: {error}'
                      for b, error in binding_errors if error]
  if (real_files and len(real_files) == len(files) and not any(e for _, e in binding_errors)
      and name in PLAN_ENTRY_POINTS | {'sweep'}):
    problem = config_problem(tuple(real_files), tuple(bindings), tuple(search_paths),
                             build_plan=name in PLAN_ENTRY_POINTS)
    missing_data = _DATA_MISSING.search(problem or '')
    if missing_data and any(missing_data.group(1).startswith(d.rstrip('/') + '/')
                            for d in page.data_dirs):
      report.skipped.append(f'{where}: plan not built, its data is written by a command '
                            f'of the page first ({missing_data.group(1)})')
    elif problem:
      what = 'do not build a plan' if name in PLAN_ENTRY_POINTS else 'do not parse'
      report.problems.append(f'{where}: its gin files and bindings {what}: {problem}')
  return report


def check_command(command: Command, origin: str, page: Page = Page()) -> Report:
  where = f'{origin}:{command.line}'
  target = _python_target(command.words)
  if target is None:
    return Report()
  kind, name, args = target
  if kind == 'module':
    if name.startswith('launch.'):
      return check_entry_point(name, args, where, page)
    top = name.split('.')[0]
    if os.path.isdir(os.path.join(REPO_ROOT, top)) and not _module_exists(name):
      return Report(problems=[f'{where}: python -m {name}: no such module in the repository'])
    return Report()
  if os.path.isabs(name) or os.path.isfile(os.path.join(REPO_ROOT, name)):
    return Report()
  if is_placeholder(name):
    return Report(skipped=[f'{where}: placeholder script {name}'])
  return Report(problems=[f'{where}: python {name}: no such script'])


def check_gin_block(block: Block, origin: str, search_paths: tuple[str, ...]) -> Report:
  where = f'{origin}:{block.line}'
  if '...' in block.body or '<' in block.body:
    return Report(skipped=[f'{where}: placeholder gin block'])
  with tempfile.TemporaryDirectory() as directory:
    path = os.path.join(directory, 'block.gin')
    with open(path, 'w') as f:
      f.write(block.body + '\n')
    problem = config_problem((path,), (), search_paths, build_plan=False)
  if problem:
    return Report(problems=[f'{where}: the gin block does not parse: {problem}'])
  return Report()


def page_of(blocks: list[Block]) -> Page:
  """The `Page` the shell blocks of a page describe."""
  values: dict[str, set[str]] = {'gin_search_paths': set(), 'output_dir': set(),
                                 'out_dir': set()}
  for block in blocks:
    if block.language not in SHELL_LANGUAGES:
      continue
    for command in shell_commands(block):
      target = _python_target(command.words)
      if not target or target[0] != 'module':
        continue
      for word, following in zip(target[2], target[2][1:] + ['']):
        flag, has_value, value = word.lstrip('-').partition('=')
        if word.startswith('-') and flag in values:
          values[flag].update(v for v in (value if has_value else following).split(',') if v)
  return Page(search_paths=tuple(sorted(values['gin_search_paths'])),
              data_dirs=tuple(sorted(values['output_dir'] | values['out_dir'])))


def check_block(block: Block, origin: str, page: Page = Page()) -> Report:
  report = Report()
  if block.language in SHELL_LANGUAGES:
    for command in shell_commands(block):
      report.extend(check_command(command, origin, page))
  elif block.language == 'gin':
    report.extend(check_gin_block(block, origin, page.search_paths))
  return report


def check_markdown(text: str, origin: str = '<text>') -> Report:
  """Checks every shell and gin block of a markdown text."""
  blocks = fenced_blocks(text)
  page = page_of(blocks)
  report = Report()
  for block in blocks:
    report.extend(check_block(block, origin, page))
  return report


# -- the docs ------------------------------------------------------------------
def doc_files() -> list[str]:
  paths = [os.path.join(REPO_ROOT, 'README.md')]
  paths += sorted(glob.glob(os.path.join(REPO_ROOT, 'docs', '**', '*.md'), recursive=True))
  return [os.path.relpath(p, REPO_ROOT) for p in paths if os.path.isfile(p)]


@functools.lru_cache(maxsize=None)
def _page(path: str) -> tuple[tuple[Block, ...], Page]:
  with open(os.path.join(REPO_ROOT, path)) as f:
    blocks = fenced_blocks(f.read())
  return tuple(blocks), page_of(blocks)


def _doc_blocks() -> list[tuple[str, int]]:
  return [(path, block.line) for path in doc_files() for block in _page(path)[0]
          if block.language in SHELL_LANGUAGES | {'gin'}]


DOC_BLOCKS = _doc_blocks()


@pytest.mark.parametrize('path,line', DOC_BLOCKS,
                         ids=[f'{path}:{line}' for path, line in DOC_BLOCKS])
def test_doc_block(path, line):
  blocks, page = _page(path)
  block = next(b for b in blocks if b.line == line)
  report = check_block(block, path, page)
  assert not report.problems, '\n'.join(report.problems)


def test_the_docs_have_entry_point_commands():
  report = Report()
  for path in doc_files():
    blocks, page = _page(path)
    for block in blocks:
      report.extend(check_block(block, path, page))  # cached: cheap
  print(f'{report.entry_point_commands} entry-point commands checked; placeholders '
        f'skipped: {len(report.skipped)}', *report.skipped, sep='\n  ')
  assert report.entry_point_commands > 0, 'no `python -m launch.X` command found in the docs'


# -- positive controls: the checker finds what it should -----------------------
def _problems(markdown: str) -> list[str]:
  return check_markdown(markdown, 'synthetic.md').problems


def test_fences_and_commands_are_read_as_a_shell_does():
  text = ('intro\n\n    ```sh\n    python -m launch.nope\n    ```\n\n'
          '~~~bash title="x"\nA=1 B=2 .venv/bin/python -m launch.train \\\n'
          '  --gin_file=a.gin --gin_bindings "x.y = {\'a\': 1}" && echo ok | cat  # c\n~~~\n'
          '````console\n$ python3 -m launch.inspect --max_rows 3\noutput line\n```\n````\n')
  blocks = fenced_blocks(text)
  assert [(b.line, b.language) for b in blocks] == [(7, 'bash'), (11, 'console')]
  assert [c.words for c in shell_commands(blocks[0])] == [
      ('.venv/bin/python', '-m', 'launch.train', '--gin_file=a.gin', '--gin_bindings',
       "x.y = {'a': 1}"), ('echo', 'ok'), ('cat',)]
  assert [(c.line, c.words) for c in shell_commands(blocks[1])] == [
      (12, ('python3', '-m', 'launch.inspect', '--max_rows', '3'))]


def test_a_good_command_passes():
  report = check_markdown(
      '```sh\n.venv/bin/python -m launch.inspect --gin_file=configs/experiments/quickstart.gin'
      " --gin_bindings='train.num_steps = 10' --max_rows 5 --noverbose --helpfull\n```\n")
  assert report.problems == [] and report.entry_point_commands == 1


def test_an_unknown_flag_is_reported():
  problems = _problems('```sh\npython -m launch.train --gin_file=configs/experiments/'
                       'quickstart.gin --num_stepz=3 --model_dir=runs/x\n```\n')
  assert problems == ['synthetic.md:2: launch.train has no flag --num_stepz']
  # a flag of another entry point is not one of this one's
  assert _problems('```sh\npython -m launch.inspect --model_dir=runs/x\n```\n') == [
      'synthetic.md:2: launch.inspect has no flag --model_dir']


def test_a_command_without_a_required_flag_is_reported():
  problems = _problems('```sh\npython -m launch.train --gin_file=configs/experiments/'
                       'quickstart.gin\n```\n')
  assert problems == ['synthetic.md:2: launch.train needs --model_dir (it has no default)']
  assert _problems('```sh\npython -m launch.train ... --cluster=slurm\n```\n') == []
  # launch.eval takes either of two flags
  assert _problems('```sh\npython -m launch.eval --name=x\n```\n') == [
      'synthetic.md:2: launch.eval needs --model_dir or --checkpoint (it has no default)']
  assert _problems('```sh\npython -m launch.eval --checkpoint=runs/x/checkpoints/ckpt-3\n'
                   'python -m launch.eval --model_dir=runs/x\n```\n') == []


def test_a_missing_entry_point_is_reported():
  assert 'launch/trian.py does not exist' in _problems('```sh\npython -m launch.trian\n```')[0]


def test_a_missing_gin_file_is_reported_and_a_placeholder_skipped():
  problems = _problems('```sh\npython -m launch.train --gin_file=configs/nope.gin '
                       '--model_dir=runs/x\n```\n')
  assert problems == ['synthetic.md:2: --gin_file=configs/nope.gin does not exist']
  report = check_markdown('```sh\npython -m launch.train --gin_file=my_project/x.gin '
                          '--model_dir=runs/x\n```\n')
  assert report.problems == [] and len(report.skipped) == 1


def test_a_bad_binding_is_reported():
  problems = _problems('```sh\npython -m launch.train --gin_file=configs/experiments/'
                       "quickstart.gin --gin_bindings='train.num_stepz = 10' --model_dir=runs/x"
                       "\n```\n")
  assert len(problems) == 1 and "--gin_bindings='train.num_stepz = 10' does not parse" in \
      problems[0]


def test_a_config_that_builds_no_plan_is_reported():
  problems = _problems('```sh\npython -m launch.inspect --gin_file=configs/experiments/'
                       "quickstart.gin --gin_bindings='train.num_steps = 10.5'\n```\n")
  assert len(problems) == 1 and 'do not build a plan' in problems[0]


def test_missing_scripts_and_modules_are_reported():
  assert _problems('```sh\npython bench/startup.py --rounds 1\n'
                   'python -m tests.run -q\n```\n') == []
  assert _problems('```sh\npython bench/nope.py\npython -m examples.nope\n```\n') == [
      'synthetic.md:2: python bench/nope.py: no such script',
      'synthetic.md:3: python -m examples.nope: no such module in the repository']


def test_a_bad_gin_block_is_reported():
  assert _problems("```gin\ntrain.num_steps = 10\ninclude 'configs/runs/train.gin'\n```\n") \
      == []
  problems = _problems('```gin\ntrian.num_steps = 10\n```\n')
  assert len(problems) == 1 and 'the gin block does not parse' in problems[0]
  assert check_markdown('```gin\ntrian.num_steps = ...\n```\n').skipped


def test_local_cluster_passes_what_follows_double_dash_to_launch_train():
  assert _problems('```sh\npython -m launch.local_cluster --num_clients=2 -- \\\n'
                   '    --gin_file=configs/experiments/lm_2d.gin --model_dir=runs/r\n```\n') == []
  assert _problems('```sh\npython -m launch.local_cluster --num_clients=2 -- '
                   '--gin_file=configs/nope.gin --modeldir=runs/r\n```\n') == [
      'synthetic.md:2: launch.train has no flag --modeldir',
      'synthetic.md:2: launch.train needs --model_dir (it has no default)',
      'synthetic.md:2: --gin_file=configs/nope.gin does not exist']


def test_data_a_page_writes_first_may_be_missing_other_data_may_not(tmp_path):
  nowhere = tmp_path / 'nowhere' / 'c'
  train = ('python -m launch.train --gin_file=configs/experiments/lm_corpus.gin --model_dir=r '
           f"--gin_bindings=\"lm_corpus.train_files = '{nowhere}/train-*.tfrecord'\"")
  problems = _problems(f'```sh\n{train}\n```\n')
  assert len(problems) == 1 and 'no file matches the train pattern' in problems[0]
  report = check_markdown('```sh\npython -m launch.prepare_data '
                          f'--output_dir={nowhere}\n{train}\n```\n')
  assert report.problems == [] and 'its data is written by a command' in report.skipped[0]


def test_gin_blocks_import_from_the_pages_search_paths():
  """A gin block that imports a user's package (the copies of
  tests/fixtures/my_project/*.gin in own-model.md) resolves it on the
  --gin_search_paths the page's commands use; a package found nowhere is a
  problem. (Once imported, a package stays in sys.modules, so this process
  cannot show the same block failing without the search path.)"""
  with open(os.path.join(REPO_ROOT, 'tests', 'fixtures', 'my_project', 'gated.gin')) as f:
    gated = f'```gin\n{f.read()}```\n'
  fixtures = '```sh\npython -m launch.inspect --gin_search_paths=tests/fixtures\n```\n'
  assert _problems(fixtures + gated) == []
  problems = _problems('```gin\nimport nowhere_project.layers\n```\n')
  assert len(problems) == 1 and 'nowhere_project' in problems[0]
