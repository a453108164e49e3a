"""The documentation site (mkdocs.yml, docs/) builds strictly, and strict means it.

`mkdocs build --strict` turns every warning into a failure, and mkdocs.yml
raises broken links and missing anchors to warnings. The positive controls
break one link in a copy of the site and check that the build then fails,
naming the broken link, so a passing build is evidence, not an accident of
configuration.

docs/reference/api.md is generated from the docstrings of layout_core/ and
plugins/ (mkdocstrings, read statically from mkdocs.yml's `paths: [.]`): the
built page must hold every extension point it documents, and an unknown
`:::` identifier, a broken cross-reference or a docstring naming a parameter
the function does not have must fail the build.
"""

import os
import shutil
import subprocess
import sys

import pytest

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The packages the API page documents (mkdocstrings reads their source).
API_SOURCES = ['layout_core', 'plugins']
API_PAGE = os.path.join('reference', 'api', 'index.html')
# Anchors the API page must have: the extension points a user's own layers,
# tasks and Keras models are written against (mkdocstrings' ids are the
# objects' full paths).
API_OBJECTS = [
    'plugins.registry.register_layer',
    'plugins.registry.register_task',
    'plugins.registry.register_keras_model',
    'layout_core.model.base.BaseLayer',
    'layout_core.model.base.BaseLayer.Params',
    'layout_core.model.base.BaseLayer.declare_variables',
    'layout_core.model.base.BaseLayer.child_params',
    'layout_core.model.base.BaseLayer.fprop_meta',
    'layout_core.model.base.BaseLayer.fprop',
    'layout_core.model.base.BaseLayer.apply',
    'layout_core.model.base.BaseLayer.weight',
    'layout_core.model.base.Declared',
    'layout_core.model.base.LayerMeta',
    'layout_core.layout.variables.Initializer',
    'layout_core.params.Params',
    'layout_core.params.Params.Define',
    'layout_core.params.Params.Set',
    'layout_core.params.Params.Instantiate',
    'layout_core.model.weights.Weights',
    'layout_core.model.weights.Weights.dense',
    'layout_core.model.weights.Weights.project',
    'layout_core.model.weights.Weights.random',
    'layout_core.step_context.StepContext',
    'layout_core.tasks.base.Task',
    'layout_core.tasks.base.Task.features',
    'layout_core.tasks.base.Task.model_inputs',
    'layout_core.tasks.base.Task.loss_and_metrics',
    'layout_core.tasks.base.Task.input_specs',
    'layout_core.tasks.base.split_rng',
    'layout_core.model.keras.import_keras',
    'layout_core.errors.ConfigError',
]

import mkdocs  # noqa: F401  the docs extra, which the test extra installs
import mkdocstrings  # noqa: F401
import mkdocstrings_handlers.python  # noqa: F401  mkdocstrings[python]
import pymdownx  # noqa: F401


def build(cwd, site_dir):
  """Runs a strict build of cwd/mkdocs.yml from cwd; returns (exit status, output)."""
  proc = subprocess.run(
      [sys.executable, '-m', 'mkdocs', 'build', '--strict', '--site-dir', str(site_dir)],
      cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300)
  return proc.returncode, proc.stdout


def site_copy(tmp_path):
  """mkdocs.yml, docs/ and the documented packages, copied under tmp_path/site
  (the pages hold their code samples themselves: docs/inline_snippets.py)."""
  root = tmp_path / 'site'
  root.mkdir()
  shutil.copy(os.path.join(REPO_ROOT, 'mkdocs.yml'), root / 'mkdocs.yml')
  shutil.copytree(os.path.join(REPO_ROOT, 'docs'), root / 'docs')
  for source in API_SOURCES:
    shutil.copytree(os.path.join(REPO_ROOT, source), root / source,
                    ignore=shutil.ignore_patterns('__pycache__'))
  return root


def replace_once(path, old, new):
  text = path.read_text()
  assert text.count(old) >= 1, f'{old!r} is not in {path}: update this test'
  path.write_text(text.replace(old, new, 1))


@pytest.fixture(scope='module')
def built_site(tmp_path_factory):
  """(exit status, output, site dir) of one strict build of the repository."""
  site_dir = tmp_path_factory.mktemp('built') / 'out'
  status, output = build(REPO_ROOT, site_dir)
  return status, output, site_dir


def test_site_builds_strictly(built_site):
  status, output, site_dir = built_site
  assert status == 0, output
  assert (site_dir / 'index.html').exists()
  # The code samples copied into the pages are rendered as code, and the
  # generator that copies them is not published as a page's file.
  own_model = (site_dir / 'own-model' / 'index.html').read_text()
  assert 'From <code>tests/fixtures/my_project/layers.py</code>' in own_model
  assert 'Stddev of the initial weights.' in own_model and '--8&lt;--' not in own_model
  assert not (site_dir / 'inline_snippets.py').exists()


def test_the_api_page_documents_the_extension_points(built_site):
  status, output, site_dir = built_site
  assert status == 0, output
  page = (site_dir / API_PAGE).read_text()
  missing = [name for name in API_OBJECTS if f'id="{name}"' not in page]
  assert not missing, f'{API_PAGE} has no section for {missing}'
  # Docstrings reached the page, not only headings: register_layer's
  # Args: section is rendered as a parameter table.
  section = page.split('id="plugins.registry.register_layer"', 1)[1].split(
      'id="plugins.registry.register_task"', 1)[0]
  assert 'Parameters' in section and 'snake_case' in section, section


def test_the_copy_builds_as_the_repository_does(tmp_path):
  root = site_copy(tmp_path)
  status, output = build(root, tmp_path / 'out')
  assert status == 0, output


@pytest.mark.parametrize('link, broken, named', [
    ('(configuration.md#layout-rules)', '(configuration.md#no-such-anchor)', 'no-such-anchor'),
    ('(sweeps.md)', '(no-such-page.md)', 'no-such-page.md'),
], ids=['missing anchor', 'missing page'])
def test_a_broken_link_fails_the_build(tmp_path, link, broken, named):
  root = site_copy(tmp_path)
  replace_once(root / 'docs' / 'getting-started.md', link, broken)
  status, output = build(root, tmp_path / 'out')
  assert status != 0, output
  assert named in output and 'getting-started.md' in output, output


@pytest.mark.parametrize('path, good, bad, named', [
    (('docs', 'reference', 'api.md'), '::: layout_core.model.base.BaseLayer\n',
     '::: layout_core.model.base.NoSuchLayer\n', 'NoSuchLayer'),
    (('docs', 'reference', 'api.md'), '][layout_core.model.base.BaseLayer]',
     '][layout_core.model.base.NoSuchBase]', 'NoSuchBase'),
    (('plugins', 'registry.py'), '    cls: The layer class',
     '    klass: The layer class', "'klass' does not appear"),
], ids=['unknown ::: identifier', 'broken cross-reference', 'unknown docstring parameter'])
def test_a_broken_api_reference_fails_the_build(tmp_path, path, good, bad, named):
  root = site_copy(tmp_path)
  replace_once(root.joinpath(*path), good, bad)
  status, output = build(root, tmp_path / 'out')
  assert status != 0, output
  assert named in output, output
