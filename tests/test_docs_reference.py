"""docs/reference/configuration.md is generated from the registered gin
configurables (`plugins.reference`), never typed: these tests fail when the
page on disk is stale or misses a configurable that configs/ use."""

import ast
import dataclasses
import glob
import inspect
import os
import re

from gin import config_parser

from layout_core.train.config import TrainConfig
from plugins import reference
from tests.conftest import REPO_ROOT

PAGE = os.path.join(REPO_ROOT, 'docs', 'reference', 'configuration.md')


def _row(text, section, parameter):
  body = text.split(f'\n## {section}\n', 1)[1].split('\n## ', 1)[0]
  rows = [line for line in body.splitlines() if line.startswith(f'| `{parameter}` |')]
  assert len(rows) == 1, (section, parameter, body)
  return rows[0]


def test_page_is_generated_from_the_code():
  with open(PAGE, encoding='utf-8') as f:
    on_disk = f.read()
  assert on_disk == reference.configuration_markdown(), (
      f'{os.path.relpath(PAGE, REPO_ROOT)} is stale; regenerate it with: {reference.COMMAND}')


def test_page_follows_a_changed_default(monkeypatch):
  """Positive control: a real change of TrainConfig's default num_steps (what
  `TrainConfig()` then gives) shows in the page's train.num_steps row only."""
  before = reference.configuration_markdown()
  names = [p.name for p in inspect.signature(TrainConfig).parameters.values()
           if p.default is not inspect.Parameter.empty and p.kind != p.KEYWORD_ONLY]
  defaults = list(TrainConfig.__init__.__defaults__)
  defaults[names.index('num_steps')] = 12345
  monkeypatch.setattr(TrainConfig.__init__, '__defaults__', tuple(defaults))
  assert TrainConfig().num_steps == 12345  # the code really changed
  after = reference.configuration_markdown()
  assert '`300`' in _row(before, 'train', 'num_steps')
  assert '`12345`' in _row(after, 'train', 'num_steps')
  changed = [(a, b) for a, b in zip(before.splitlines(), after.splitlines()) if a != b]
  assert changed == [(_row(before, 'train', 'num_steps'), _row(after, 'train', 'num_steps'))]


def test_page_documents_the_field_comment_convention():
  text = reference.configuration_markdown()
  assert 'total optimizer steps' in _row(text, 'train', 'num_steps')       # comment after
  assert 'profiler trace' in _row(text, 'train', 'profile_steps')          # comment above
  assert "`{'data': 8}`" in _row(text, 'mesh', 'shape')                    # default_factory
  assert "'adam' \\| 'adafactor'" in _row(text, 'optimizer', 'name')        # '|' escaped
  assert '| required |' in _row(text, 'bytes_task', 'path')
  assert 'Input and output width.' in _row(text, 'feed_forward', 'input_dim')  # Params doc
  fields = {f.name for f in dataclasses.fields(TrainConfig)}
  assert fields == {line.split('`')[1] for line in text.split('\n## train\n')[1]
                    .split('\n## ')[0].splitlines() if line.startswith('| `')}


class _Delegate(config_parser.ParserDelegate):
  def configurable_reference(self, scoped_configurable_name, evaluate):
    return scoped_configurable_name

  def macro(self, macro_name):
    return macro_name


def test_every_configurable_used_in_configs_has_a_section():
  used = set()
  files = glob.glob(os.path.join(REPO_ROOT, 'configs', '**', '*.gin'), recursive=True)
  assert files
  for path in files:
    with open(path, encoding='utf-8') as f:
      for statement in config_parser.ConfigParser(f.read(), _Delegate()):
        if isinstance(statement, config_parser.BindingStatement) and statement.selector:
          used.add(statement.selector.split('.')[-1])  # 'meshgin.train' -> 'train'
  assert {'train', 'mesh', 'transformer_lm', 'transformer_block'} <= used
  headings = {line[3:] for line in reference.configuration_markdown().splitlines()
              if line.startswith('## ')}
  assert not used - headings, f'configurables used in configs/ without a section: {used - headings}'
  assert len(headings) == len(reference.registered_names())  # one unique heading each


def _code_constants() -> dict[str, str]:
  """ALL_CAPS names assigned at the top of a module of layout_core/, plugins/
  or launch/ -> that module's path (read with ast: nothing imported)."""
  constants: dict[str, str] = {}
  for package in ('layout_core', 'plugins', 'launch'):
    for path in sorted(glob.glob(os.path.join(REPO_ROOT, package, '**', '*.py'), recursive=True)):
      with open(path, encoding='utf-8') as f:
        body = ast.parse(f.read()).body
      for node in body:
        targets = (node.targets if isinstance(node, ast.Assign)
                   else [node.target] if isinstance(node, ast.AnnAssign) else [])
        for target in targets:
          if isinstance(target, ast.Name) and re.fullmatch(r'[A-Z][A-Z0-9_]*[A-Z0-9]', target.id):
            constants.setdefault(target.id, os.path.relpath(path, REPO_ROOT))
  return constants


def test_page_shows_values_not_constant_names():
  """A reader of the reference sees 'none' | 'block' | 'full', not REMAT_POLICIES."""
  constants = _code_constants()
  assert {'REMAT_POLICIES', 'AUTO_MIN_PARAMETERS', 'DEVICE_TYPES'} <= set(constants)
  with open(PAGE, encoding='utf-8') as f:
    lines = f.read().splitlines()
  found = [f'line {number}: {name} (defined in {constants[name]})'
           for number, line in enumerate(lines, 1)
           for name in re.findall(r'\b[A-Z][A-Z0-9_]*[A-Z0-9]\b', line) if name in constants]
  assert not found, (
      f'{os.path.relpath(PAGE, REPO_ROOT)} names code constants instead of their values: '
      f'{"; ".join(found)}. Give the constant a short form in '
      f'plugins.reference.constant_text, or write the value in the comment or docstring '
      f'the page reads; then regenerate it with: {reference.COMMAND}')


def test_constant_names_become_their_values():
  """Positive control for the check above: the generator replaces a constant
  of the owner's module by its value, and leaves other capitals alone."""
  assert (reference.with_constant_values('remat: REMAT_POLICIES, on CPU', TrainConfig)
          == "remat: 'none' | 'block' | 'full', on CPU")
  from layout_core.optim.config import OptimizerConfig  # pylint: disable=import-outside-toplevel
  assert (reference.with_constant_values('at least AUTO_MIN_PARAMETERS', OptimizerConfig)
          == 'at least 1,200,000')
  text = reference.configuration_markdown()
  assert "'none' \\| 'block' \\| 'full'" in _row(text, 'train', 'remat')
  assert '1,200,000 parameters' in _row(text, 'optimizer', 'shard_state')
  assert "'CPU' \\| 'GPU' \\| 'TPU'" in _row(text, 'mesh', 'device_type')
