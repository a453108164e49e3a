"""docs/performance.md is bench/report.py's rendering of bench/results/*.json,
and every figure there says when, where and on which commit it was measured."""

from __future__ import annotations

import glob
import json
import os
import shutil

import pytest

from bench import report

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGE = os.path.join(REPO_ROOT, 'docs', 'performance.md')
RESULT_FILES = sorted(glob.glob(os.path.join(report.RESULTS, '*.json')))


def test_the_page_is_the_rendering_of_the_results():
  with open(PAGE) as f:
    on_disk = f.read()
  assert on_disk == report.performance_markdown(), (
      f'docs/performance.md is not the rendering of bench/results/*.json: run '
      f'`{report.COMMAND}` from the repository root')


def test_there_are_results():
  assert RESULT_FILES, 'bench/results/ holds no *.json'


@pytest.mark.parametrize('path', RESULT_FILES, ids=os.path.basename)
def test_every_result_says_when_where_and_on_which_commit(path):
  with open(path) as f:
    results = json.load(f)
  assert isinstance(results, dict), f'{path}: not a JSON object'
  missing = [key for key in ('date', 'commit', 'machine') if not results.get(key)]
  assert not missing, f'{os.path.relpath(path, REPO_ROOT)} lacks {", ".join(missing)}'
  assert isinstance(results['machine'], dict)
  assert {'cores', 'processor', 'host'} <= set(results['machine'])


def test_a_changed_figure_changes_the_page(tmp_path):
  """Positive control: the page depends on the figures, not just the file names."""
  for path in RESULT_FILES:
    shutil.copy(path, tmp_path)
  assert report.performance_markdown(str(tmp_path)) == report.performance_markdown()
  changed = tmp_path / 'startup.json'
  results = json.loads(changed.read_text())
  results['best']['plain']['first_step'][0] += 1.0
  changed.write_text(json.dumps(results))
  assert report.performance_markdown(str(tmp_path)) != report.performance_markdown()


def test_rows_and_tables_of_named_figures_render_as_tables(tmp_path):
  (tmp_path / 'rows.json').write_text(json.dumps(
      {'date': 'd', 'commit': 'c', 'machine': {'cores': 2, 'processor': 'p', 'host': 'h'},
       'rows': [{'size': 512, 'gflops': 1.5}, {'size': 1024, 'gflops': 2.25, 'ok': False}],
       'by_name': {'one device': {'ms': 3.0}, 'mesh': {'ms': 4.5}}}))
  page = report.performance_markdown(str(tmp_path))
  assert '| size | gflops | ok |' in page and '| 1024 | 2.25 | False |' in page
  assert '|  | ms |' in page and '| mesh | 4.50 |' in page


def test_other_results_get_a_table_and_a_missing_command_says_so(tmp_path):
  (tmp_path / 'zz_other.json').write_text(json.dumps(
      {'date': 'd', 'commit': 'c', 'machine': {'cores': 2, 'processor': 'p', 'host': 'h'},
       'steps_per_second': 12.3456, 'examples': 32, 'flag': True, 'nested': {'a': 1}}))
  page = report.performance_markdown(str(tmp_path))
  assert '## zz_other.json' in page
  assert '| steps_per_second | 12.35 |' in page
  assert '| examples | 32 |' in page
  assert '| flag | True |' in page  # every figure is shown, nested ones as their own table
  assert 'nested:' in page and '| a | 1 |' in page
  assert '- command: not recorded' in page
  assert page == report.performance_markdown(str(tmp_path))  # deterministic
