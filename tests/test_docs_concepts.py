"""docs/concepts.md: its figures are the drawing of real run records, and its
glossary is one every page that uses its words links to.

The figures (docs/img/concepts-*.svg) are drawn by tests/concept_figures.py
from the `mesh.json` that meshgin's run record (`plugins.record.record_run`)
writes for real configs built on this session's 8 virtual CPU devices. Here
they are drawn again and compared with the checked-in files; each device's
cell is checked against the slice its layout rule gives it, worked out by
hand below (an independent reference), and a changed record must change the
drawing (positive control).
"""

from __future__ import annotations

import copy
import glob
import json
import os
import re
import xml.etree.ElementTree as ElementTree

import pytest
from markdown.extensions.toc import slugify

from tests import concept_figures
from tests.conftest import REPO_ROOT

DOCS = os.path.join(REPO_ROOT, 'docs')
PAGE = os.path.join(DOCS, 'concepts.md')
SVG = '{http://www.w3.org/2000/svg}'
REDRAW = (f'the figures of docs/concepts.md are not what meshgin records now: run '
          f'`{concept_figures.COMMAND}` from the repository root and check the new drawings')

# Glossary anchor -> how a page uses the word (outside fenced code). Every
# `### Term` under concepts.md's `## Glossary` has exactly one entry here.
TERMS = {
    'batch-axis': r'\bbatch axis\b',
    'bubble': r'\bbubbles?\b',
    'client': r'(?<![-\w])clients?\b',
    'clock-order': r'\bclock order\b',
    'collective': r'\b(all-gathers?|all-reduces?|reduce-scatters?|all-to-alls?|collectives?)\b',
    'dvariable': r'\bDVariables?\b',
    'fprop': r'\bfprop\b',
    'fsdp': r'\bFSDP\b',
    'layout': r'\blayouts?\b(?! rules?\b)',
    'layout-rule': r'\blayout rules?\b',
    'lowering': r'\blowerings?\b',
    'megatron': r'\bMegatron\b',
    'mesh': r'(?<![-\w.])mesh(es)?\b(?![ -]ax[ei]s\b| tab\b|[._])',
    'mesh-axis': r'\bmesh ax[ei]s\b',
    'micro-batch': r'\bmicro-batch(es)?\b',
    'micro-step': r'\bmicro-steps?\b',
    'params': r'(?-i:\bParams\b)',
    'relayout': r'\brelayouts?\b',
    'remat': r'\bremat(erialisation|erialization)?\b',
    'replica': r'\breplicas?\b',
    'replicated': r'\breplicated\b',
    'sharded': r'\bsharded\b',
    'slot': r'\bslots?\b',
    'spec': r'\bspecs?\b',
    'spmd': r'(?-i:\bSPMD\b)',
    'stage': r'\bstages?\b',
    'sub-mesh': r'\bsub-mesh(es)?\b',
    'zero-1': r'\bZeRO-1\b',
}
# Pages that are generated from something else (their generators would have
# to write the links): bench/report.py's rendering of bench/results/.
GENERATED = {'performance.md'}
GLOSSARY_LINK = re.compile(r'\]\(concepts\.md(#[\w-]+)?\)')
FENCE = re.compile(r'^(```|~~~).*?^\1', re.MULTILINE | re.DOTALL)


@pytest.fixture(scope='module')
def drawn(devices8, tmp_path_factory):
  """(folder of freshly drawn figures, run name -> its mesh.json)."""
  work = tmp_path_factory.mktemp('concept_figures')
  concept_figures.draw_all(str(work / 'img'), str(work / 'runs'))
  docs = {}
  for name in concept_figures.RUNS:
    with open(work / 'runs' / name / 'mesh.json') as f:
      docs[name] = json.load(f)
  return work / 'img', docs


def figure(name: str) -> concept_figures.Figure:
  return next(f for f in concept_figures.FIGURES if f.name == name)


def cells(svg: str) -> dict[int, tuple[str, list[str]]]:
  """Device id -> (its cell's fill, its cell's lines of text)."""
  found = {}
  for group in ElementTree.fromstring(svg).iter(f'{SVG}g'):
    if group.get('id', '').startswith('device-'):
      fill = group.find(f'{SVG}rect').get('fill')
      found[int(group.get('id')[len('device-'):])] = (
          fill, [text.text for text in group.iter(f'{SVG}text')])
  return found


def read(path: str) -> str:
  with open(path, encoding='utf-8') as f:
    return f.read()


# -- the figures ----------------------------------------------------------------------
def test_the_checked_in_figures_are_the_drawing_of_real_run_records(drawn):
  out, _ = drawn
  for name in sorted(os.listdir(out)):
    checked_in = os.path.join(DOCS, 'img', name)
    assert os.path.exists(checked_in), f'docs/img/{name} is missing: {REDRAW}'
    assert read(checked_in) == read(out / name), f'docs/img/{name} differs: {REDRAW}'
  drawn_names = {f.name for f in concept_figures.FIGURES}
  on_disk = glob.glob(os.path.join(DOCS, 'img', 'concepts-*.svg'))
  stray = sorted(os.path.basename(p) for p in on_disk if os.path.basename(p) not in drawn_names)
  assert not stray, f'docs/img/ holds figures tests/concept_figures.py no longer draws: {stray}'


def test_every_figure_is_on_the_page_with_a_description():
  page = read(PAGE)
  for f in concept_figures.FIGURES:
    match = re.search(r'!\[(.+)\]\(img/' + re.escape(f.name) + r'\)', page)
    assert match and len(match.group(1)) > 40, (
        f'docs/concepts.md shows no img/{f.name} with a description (alt text)')


@pytest.mark.parametrize('name, expected', [
    # hand-worked from the rules: data=2 x model=4, device d at (d // 4, d % 4)
    ('concepts-mesh.svg', lambda d: f'coords ({d // 4}, {d % 4})'),
    # w_in [64, 256], ('unsharded', 'model'): 4 column blocks of 64
    ('concepts-sharded.svg', lambda d: f'[0:64, {64 * (d % 4)}:{64 * (d % 4) + 64}]'),
    # ln_ffn/scale [64], no rule: whole everywhere
    ('concepts-replicated.svg', lambda d: '[0:64]'),
    # w_in with train.fsdp: stored ('data', 'model'), 2 row blocks of 32 x 4 column blocks
    ('concepts-fsdp.svg',
     lambda d: f'[{32 * (d // 4)}:{32 * (d // 4) + 32}, {64 * (d % 4)}:{64 * (d % 4) + 64}]'),
    # lm_pipeline: block_003 on stage 1 (CPU:4-7, data 2 x model 2); w_in [64, 512]
    ('concepts-pipeline.svg',
     lambda d: 'holds none' if d < 4 else f'[0:64, {256 * (d % 2)}:{256 * (d % 2) + 256}]'),
], ids=lambda v: v if isinstance(v, str) else '')
def test_each_device_shows_the_slice_its_rule_gives_it(drawn, name, expected):
  out, _ = drawn
  found = cells(read(out / name))
  assert sorted(found) == list(range(8)), sorted(found)
  for d, (_, lines) in found.items():
    assert lines == [f'CPU:{d}', expected(d)], (name, d, lines)


def test_replicas_share_a_colour_and_other_slices_do_not(drawn):
  out, _ = drawn
  fills = {name: {d: fill for d, (fill, _) in cells(read(out / name)).items()}
           for name in ('concepts-sharded.svg', 'concepts-replicated.svg', 'concepts-fsdp.svg',
                        'concepts-pipeline.svg')}
  sharded = fills['concepts-sharded.svg']
  assert all(sharded[d] == sharded[d + 4] for d in range(4)) and len(set(sharded.values())) == 4
  assert len(set(fills['concepts-replicated.svg'].values())) == 1
  assert len(set(fills['concepts-fsdp.svg'].values())) == 8
  pipeline = fills['concepts-pipeline.svg']
  assert len({pipeline[d] for d in range(4)}) == 1  # stage 0: none of it
  assert pipeline[4] == pipeline[6] != pipeline[5] == pipeline[7] != pipeline[0]


def test_a_changed_record_changes_the_drawing(drawn):
  """Positive control: the drawing follows the record, not the figure list."""
  _, docs = drawn
  sharded = figure('concepts-sharded.svg')
  doc = copy.deepcopy(docs['lm_2d'])
  before = concept_figures.figure_svg(sharded, doc)
  assert before == concept_figures.figure_svg(sharded, copy.deepcopy(docs['lm_2d']))
  variable = next(v for v in doc['variables'] if v['path'] == sharded.variable)
  first, second = variable['slices'][:2]
  first['devices'], second['devices'] = second['devices'], first['devices']
  after = concept_figures.figure_svg(sharded, doc)
  assert after != before
  assert cells(after)[0][1] == ['CPU:0', '[0:64, 64:128]']

  mesh = figure('concepts-mesh.svg')
  renamed = copy.deepcopy(docs['lm_2d'])
  renamed['mesh']['axes'][1][0] = 'tensor'
  drawing = concept_figures.figure_svg(mesh, renamed)
  assert drawing != concept_figures.figure_svg(mesh, docs['lm_2d']) and 'tensor 3' in drawing


def test_the_numbers_on_the_page_are_the_records(drawn):
  _, docs = drawn
  page = read(PAGE)
  lm_2d, fsdp = docs['lm_2d'], docs['lm_2d_fsdp']
  w_in = next(v for v in lm_2d['variables'] if v['path'] == 'lm/stack/block_000/ffn/w_in')
  numbers = {
      'w_in bytes': w_in['bytes_total'], 'w_in bytes per device': w_in['bytes_per_device'],
      'parameter bytes': sum(v['bytes_total'] for v in lm_2d['variables']),
      'parameter bytes per device': lm_2d['devices'][0]['bytes']['parameters'],
      'with FSDP': fsdp['devices'][0]['bytes']['parameters'],
  }
  missing = {what: f'{n:,}' for what, n in numbers.items() if f'{n:,}' not in page}
  assert not missing, f'docs/concepts.md does not give these figures of the records: {missing}'
  assert lm_2d['devices'][0]['bytes']['optimizer'] == 2 * numbers['parameter bytes per device']


# -- the glossary ---------------------------------------------------------------------
def glossary_anchors(page: str) -> list[str]:
  section = page.split('\n## Glossary\n', 1)[1].split('\n## ', 1)[0]
  return [slugify(title.strip(), '-') for title in re.findall(r'^### (.+)$', section, re.MULTILINE)]


def terms_used(text: str) -> list[str]:
  prose = FENCE.sub('', text)
  return [anchor for anchor, pattern in TERMS.items()
          if re.search(pattern, prose, re.IGNORECASE)]


def unlinked_use(text: str) -> list[str]:
  """The glossary terms a page uses, if it never links to the concepts page."""
  return [] if GLOSSARY_LINK.search(text) else terms_used(text)


def user_pages() -> list[str]:
  return sorted(p for p in glob.glob(os.path.join(DOCS, '*.md'))
                if os.path.basename(p) not in GENERATED | {'concepts.md'})


def test_the_glossary_defines_exactly_the_terms_checked_here():
  anchors = glossary_anchors(read(PAGE))
  assert anchors == sorted(anchors), 'keep the glossary in alphabetical order'
  assert set(anchors) == set(TERMS), (
      f'glossary entries without a pattern here: {sorted(set(anchors) - set(TERMS))}; '
      f'patterns without an entry: {sorted(set(TERMS) - set(anchors))}')


def test_every_page_that_uses_a_glossary_term_links_to_the_glossary():
  unlinked = {os.path.basename(p): unlinked_use(read(p)) for p in user_pages()}
  unlinked = {page: terms for page, terms in unlinked.items() if terms}
  assert not unlinked, (
      'these pages use words the glossary defines but never link to it; link the first '
      'use of each, e.g. [micro-batch](concepts.md#micro-batch): '
      + '; '.join(f'{page}: {", ".join(terms)}' for page, terms in unlinked.items()))


def test_the_glossary_check_sees_a_missing_link():
  """Positive control for the check above, and what it leaves out."""
  assert unlinked_use('Each micro-batch runs on every stage.\n') == ['micro-batch', 'stage']
  assert unlinked_use('Each [micro-batch](concepts.md#micro-batch) runs.\n') == []
  assert unlinked_use('```sh\n# one micro-batch\n```\nNothing else.\n') == []
  assert unlinked_use('The Mesh tab, a sub-mesh, model.params, a multi-client run.\n') == [
      'sub-mesh']
