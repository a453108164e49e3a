"""The documentation site (mkdocs.yml, docs/) builds strictly, and strict means it.

`mkdocs build --strict` turns every warning into a failure, and mkdocs.yml
raises broken links and missing anchors to warnings. The positive controls
break one link in a copy of the site and check that the build then fails,
naming the broken link, so a passing build is evidence, not an accident of
configuration.
"""

import os
import shutil
import subprocess
import sys

import pytest

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Files the pages include with pymdownx.snippets (base_path: the build's cwd).
SNIPPET_SOURCES = [os.path.join('tests', 'fixtures', 'my_project'),
                   os.path.join('examples', 'slurm')]

import mkdocs  # noqa: F401  the docs extra, which the test extra installs
import pymdownx  # noqa: F401


def build(cwd, site_dir):
  """Runs a strict build of cwd/mkdocs.yml from cwd; returns (exit status, output)."""
  proc = subprocess.run(
      [sys.executable, '-m', 'mkdocs', 'build', '--strict', '--site-dir', str(site_dir)],
      cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300)
  return proc.returncode, proc.stdout


def site_copy(tmp_path):
  """mkdocs.yml, docs/ and the snippet sources, copied under tmp_path/site."""
  root = tmp_path / 'site'
  root.mkdir()
  shutil.copy(os.path.join(REPO_ROOT, 'mkdocs.yml'), root / 'mkdocs.yml')
  shutil.copytree(os.path.join(REPO_ROOT, 'docs'), root / 'docs')
  for source in SNIPPET_SOURCES:
    shutil.copytree(os.path.join(REPO_ROOT, source), root / source,
                    ignore=shutil.ignore_patterns('__pycache__'))
  return root


def replace_once(path, old, new):
  text = path.read_text()
  assert text.count(old) >= 1, f'{old!r} is not in {path}: update this test'
  path.write_text(text.replace(old, new, 1))


def test_site_builds_strictly(tmp_path):
  status, output = build(REPO_ROOT, tmp_path / 'out')
  assert status == 0, output
  assert (tmp_path / 'out' / 'index.html').exists()


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
