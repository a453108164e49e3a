"""Every benchmark figure in the docs is what its results file holds.

docs/performance.md is bench/report.py's rendering of bench/results/*.json
(regenerate it with `python -m bench.report > docs/performance.md`), a page a
person can read: a summary first, short sections, no raw JSON or TensorFlow
messages. Other pages quote figures from the same files; bench/figures.py
renders each one (`FIGURES`) and the checks here hold the pages to them:

* each figure marked `quoted` is written in a paragraph that cites a
  benchmark: one naming the script that measured it, or one linking to the
  pages that hold the measurements (performance, limits-measured, benchmarks);
* every figure-like number in such a paragraph (ms, s, GiB, MiB, M, %, a
  ratio written 1.23x or 0.61) is the rendering of one of `FIGURES` (of the
  scripts the paragraph names, where it names any), or a setting listed in
  `NOT_MEASURED`.

A paragraph is found on whichever page holds it (docs/*.md, README.md), so
moving it between pages breaks nothing. The positive controls change a figure
in a copy of the results, and add an unchecked figure to a copy of a page,
and show that the check then fails naming the page and the figure.
"""

from __future__ import annotations

import glob
import json
import os
import re
import shutil

import pytest

from bench import report
from bench.figures import FIGURES

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGE = os.path.join(REPO_ROOT, 'docs', 'performance.md')
RESULT_FILES = sorted(glob.glob(os.path.join(report.RESULTS, '*.json')))

# bench/step.py, python -m bench.step, bench/limits/bf16_matmul_limit.py
BENCH_SCRIPT = re.compile(r'bench[/.]((?:limits[/.])?[a-z0-9_]+)')
RESULTS_LINK = re.compile(r'(?:performance|limits-measured|benchmarks)\.md')
# A figure: a number with a unit, a ratio written 1.23x, or a fraction 0.61.
FIGURE_TEXT = re.compile(
    r'(?<![\w.\[])(?:\d+(?:\.\d+)?(?: ?(?:ms|s|GiB|MiB|GB|MB|M)\b|x(?!\w)|%)|0\.\d+)')
# Written near a bench script but settings, not measurements.
NOT_MEASURED = {
    '4x wider': 'the 4x wider lm_small: a model, named by its width',
    '1 MiB buffers': "the read buffer bench/limits/truncated_tfrecord_limit.py sets",
    '1.2M parameters': "optimizer.shard_state = 'auto''s threshold, a setting",
}


def page_paths() -> list[str]:
  """The pages that may quote a figure: docs/*.md but the generated ones, README.md."""
  pages = [p for p in sorted(glob.glob(os.path.join(REPO_ROOT, 'docs', '*.md')))
           if os.path.basename(p) != 'performance.md']
  return pages + [os.path.join(REPO_ROOT, 'README.md')]


def read_pages() -> dict[str, str]:
  pages = {}
  for path in page_paths():
    with open(path) as f:
      pages[os.path.relpath(path, REPO_ROOT)] = f.read()
  return pages


def paragraphs(text: str) -> list[str]:
  """A page's paragraphs, top-level list items (their nested items included),
  headings and table rows, outside fenced code."""
  blocks: list[str] = []
  current: list[str] = []
  fenced = False
  for line in text.splitlines():
    if line.lstrip().startswith('```'):
      fenced = not fenced
      blocks.append('\n'.join(current))
      current = []
      continue
    if fenced:
      continue
    if not line.strip() or line.startswith(('* ', '- ', '|', '#')) or re.match(r'\d+\. ', line):
      blocks.append('\n'.join(current))
      current = []
    if line.strip():
      current.append(line)
  blocks.append('\n'.join(current))
  return [b for b in blocks if b]


def quotes(paragraph: str, text: str) -> bool:
  return re.search(r'(?<![\w.])' + re.escape(text) + r'(?!\d)', paragraph) is not None


def figure_problems(results: dict[str, dict], pages: dict[str, str]) -> list[str]:
  """What on the pages disagrees with the results: [] when every figure agrees."""
  rendered = {name: (f, f.render(results[f.file]), report.script_of(results[f.file], f.file))
              for name, f in FIGURES.items() if f.file in results}
  citing = []  # (page, paragraph, the scripts it names: None if it only links)
  for page, text in pages.items():
    for paragraph in paragraphs(text):
      paragraph = ' '.join(paragraph.split())  # a figure may wrap across lines
      scripts = {f'bench/{name.replace(".", "/")}.py'
                 for name in BENCH_SCRIPT.findall(paragraph)}
      if scripts or RESULTS_LINK.search(paragraph):
        citing.append((page, paragraph, scripts or None))
  problems = []
  for name, (f, text, script) in rendered.items():
    if f.quoted and not any(quotes(paragraph, text) for _, paragraph, scripts in citing
                            if scripts is None or script in scripts):
      problems.append(f'figure {name!r} reads {text!r} in bench/results/{f.file}, but no page '
                      f'quotes it in a paragraph naming {script} or linking to its results')
  for page, paragraph, scripts in citing:
    allowed = {token for f, text, script in rendered.values() if scripts is None or script in scripts
               for token in [text, *FIGURE_TEXT.findall(text)]}
    for phrase in NOT_MEASURED:
      paragraph = paragraph.replace(phrase, '')
    for token in FIGURE_TEXT.findall(paragraph):
      if token not in allowed:
        problems.append(
            f'{page}: {token!r} is not a figure of bench/figures.py FIGURES (from the results of '
            f'{", ".join(sorted(scripts or ["any script"]))}): in "{paragraph[:90]}..."')
  return problems


# ------------------------------------------------------------------ the page


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


def test_the_page_reads_as_a_page():
  page = report.performance_markdown()
  lines = page.splitlines()
  # 300 lines before the layout suggester's three sections (#48) joined the
  # page, 325 before the Hugging Face import's (#56), 340 before Grappler's passes, 343
  # before the import's garbage collection, 346 before opening streams, 349 before
  # bf16 einsums (#54), 356 before preference tuning (#75) and 366 before a frozen base in
  # bfloat16 or int8 (#76: its accuracy and memory), 390 before mixture of experts (#74),
  # 420 before gathering a narrow weight (#76).
  assert len(lines) <= 425, f'docs/performance.md has {len(lines)} lines: make it shorter'
  assert lines[0] == '# Performance' and '## Summary' in lines[:8]
  headings = [line for line in lines if line.startswith('#')]
  assert len(headings) == len(set(headings)), 'two sections share a heading'
  for raw in ('{"', "{'", 'Error:', 'function_node', '__inference', report.DIRTY.strip()):
    assert raw not in page, f'docs/performance.md shows raw text {raw!r}'
  assert page.count('† measured with uncommitted changes') == 1


def test_every_results_file_has_a_section():
  page = report.performance_markdown()
  for path in RESULT_FILES:
    assert f'`bench/results/{os.path.basename(path)}`' in page


def test_every_figure_is_on_the_page():
  page = report.performance_markdown()
  results = report.load()
  missing = [name for name, f in FIGURES.items() if f.render(results[f.file]) not in page]
  assert not missing, f'FIGURES not shown on docs/performance.md: {missing}'


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


def test_an_unknown_results_file_gets_a_plain_table(tmp_path):
  (tmp_path / 'zz_other.json').write_text(json.dumps(
      {'date': '2026-01-02T03:04:05', 'commit': 'abcdef0123' + report.DIRTY,
       'machine': {'cores': 2, 'processor': 'p', 'host': 'h'},
       'steps_per_second': 12.3456, 'examples': 32, 'flag': True,
       'rows': [{'size': 512, 'error': 'InvalidArgumentError: {{function_node __inference_f_12}} x'}]}))
  page = report.performance_markdown(str(tmp_path))
  assert '### Other results: zz_other.json' in page
  assert '| steps_per_second | 12.35 |' in page and '| examples | 32 |' in page
  assert '| rows / 1 / error | fails (InvalidArgumentError) |' in page
  assert 'function_node' not in page
  assert 'commit `abcdef0`†' in page and 'a command not recorded' in page
  assert page == report.performance_markdown(str(tmp_path))  # deterministic


def test_tensorflow_messages_become_plain_outcomes():
  assert report.outcome(None) == 'ok'
  assert report.outcome("UnknownError: Send and receive hosts don't match") == (
      'fails to compile (send and receive hosts differ)')
  assert report.outcome('DataLossError: {{function_node __wrapped__X}} truncated record at 6') == (
      'error: truncated record')
  assert report.outcome('ValueError: something new') == 'fails (ValueError)'


# ------------------------------------------------------------------ the other pages


def test_every_quoted_figure_is_its_results_figure():
  problems = figure_problems(report.load(), read_pages())
  assert not problems, ('figures on the docs pages differ from bench/results/ '
                        '(fix the page, or add the figure to bench/figures.py):\n'
                        + '\n'.join(problems))


def test_a_changed_result_fails_naming_the_page_and_the_figure(tmp_path):
  """Positive control: the SPMD engine's rate, 0.61 on the pages, measured anew."""
  results = report.load()
  pages = read_pages()
  assert not figure_problems(results, pages)
  results['step.json']['pipeline']['spmd S=2 M=8']['ratio']['value'] = 0.7123
  problems = '\n'.join(figure_problems(results, pages))
  assert "figure 'pipeline.spmd' reads '0.71' in bench/results/step.json" in problems
  quoted_on = [page for page, text in pages.items()
               if any(quotes(p, '0.61') for p in paragraphs(text) if 'bench/step.py' in p)]
  assert quoted_on
  for page in quoted_on:
    assert f"{page}: '0.61' is not a figure" in problems


def test_a_figure_the_coverage_scan_cannot_see_is_still_checked():
  """Positive control: '16.8 whole' has no unit; its quote is checked all the same."""
  results = report.load()
  results['fsdp_collectives.json']['ways']['per_replica']['peak_in_whole_bf16_weights'] = 18.25
  problems = '\n'.join(figure_problems(results, read_pages()))
  assert "figure 'collectives.per_replica' reads '18.2 whole'" in problems


def test_an_unchecked_figure_near_a_bench_script_fails():
  """Positive control: a new figure must be added to FIGURES before a page quotes it."""
  pages = read_pages()
  pages['docs/new-page.md'] = ('# New\n\nThe sub-mesh engine ran 123 ms a step and 1.7x '
                               'slower (`bench/step.py`).\n')
  problems = figure_problems(report.load(), pages)
  assert any(p.startswith("docs/new-page.md: '123 ms' is not a figure") for p in problems)
  assert any(p.startswith("docs/new-page.md: '1.7x' is not a figure") for p in problems)


def test_paragraphs_split_list_items_and_skip_code():
  text = 'Intro line\nstill intro.\n\n* one\n  * nested\n* two\n\n```sh\nbench/step.py 5 ms\n```\n'
  assert paragraphs(text) == ['Intro line\nstill intro.', '* one\n  * nested', '* two']
