"""The figures of docs/concepts.md, drawn from the `mesh.json` of real runs.

    python -m tests.concept_figures            # rewrites docs/img/concepts-*.svg
    python -m tests.concept_figures figs/  # or writes them elsewhere

Each run in `RUNS` is built the way `launch.train` builds it before its first
step, in this process on 8 virtual CPU devices: gin files -> typed plan
(`plugins.plan.make_plan`) -> mesh, model and optimizer
(`plugins.training.build_trainer`) -> the run record
(`plugins.record.record_run`), which writes `mesh.json` from the built
variables' own DTensor layouts. Nothing trains. Each figure in `FIGURES` then
draws the mesh of one such `mesh.json`, or one of its variables: a grid of
devices, each cell naming the slice its device holds, and the variable as a
rectangle cut into those slices (`render`, a pure function of the document).

tests/test_docs_concepts.py redraws every figure and compares it with the
checked-in file, so the page cannot drift from what meshgin really does.
The output is deterministic: no dates, everything in document order.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
import tempfile
from typing import Sequence
from xml.sax.saxutils import escape, quoteattr

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
IMG_DIR = os.path.join(REPO_ROOT, 'docs', 'img')
COMMAND = 'python -m tests.concept_figures'
NUM_DEVICES = 8


@dataclasses.dataclass(frozen=True)
class Run:
  config: str                 # a gin file, relative to the repository root
  bindings: tuple[str, ...] = ()

  def describe(self) -> str:
    extra = ''.join(f' --gin_bindings="{b}"' for b in self.bindings)
    return f'--gin_file={self.config}{extra}'


@dataclasses.dataclass(frozen=True)
class Figure:
  name: str                   # file name under docs/img/
  run: str                    # a key of RUNS
  variable: str | None        # a variable path; None: the bare mesh


RUNS = {
    'lm_2d': Run('configs/experiments/lm_2d.gin'),
    'lm_2d_fsdp': Run('configs/experiments/lm_2d.gin', ('train.fsdp = True',)),
    'lm_pipeline': Run('configs/experiments/lm_pipeline.gin'),
}

FIGURES = (
    Figure('concepts-mesh.svg', 'lm_2d', None),
    Figure('concepts-sharded.svg', 'lm_2d', 'lm/stack/block_000/ffn/w_in'),
    Figure('concepts-replicated.svg', 'lm_2d', 'lm/stack/block_000/ln_ffn/scale'),
    Figure('concepts-fsdp.svg', 'lm_2d_fsdp', 'lm/stack/block_000/ffn/w_in'),
    Figure('concepts-pipeline.svg', 'lm_pipeline', 'lm/stack/block_003/ffn/w_in'),
)


# -- the run records ----------------------------------------------------------------
def record_mesh_json(run: Run, model_dir: str) -> dict:
  """Builds `run` as launch.train does before its first step, writes its run
  record into `model_dir` and returns the `mesh.json` read back from disk.
  Needs NUM_DEVICES devices (see `main`, or tests/conftest.py)."""
  # pylint: disable=import-outside-toplevel
  import gin
  from plugins import gin_setup, plan as plan_lib
  from plugins.record import record_run
  from plugins.training import build_trainer
  os.makedirs(model_dir, exist_ok=True)
  gin.clear_config()
  try:
    gin_setup.parse_gin(files=[os.path.join(REPO_ROOT, run.config)], bindings=list(run.bindings))
    plan = plan_lib.make_plan()
    record_run(build_trainer(plan), plan, model_dir=model_dir)
  finally:
    gin.clear_config()
  with open(os.path.join(model_dir, 'mesh.json')) as f:
    return json.load(f)


def record_all(work_dir: str) -> dict[str, dict]:
  """Every run of RUNS recorded under work_dir/<name>; name -> mesh.json."""
  return {name: record_mesh_json(run, os.path.join(work_dir, name))
          for name, run in RUNS.items()}


# -- drawing ------------------------------------------------------------------------
# Light fills, one per distinct slice (in the order of their first device).
PALETTE = ('#9ecae1', '#fdae6b', '#a1d99b', '#fc9272', '#bcbddc', '#d9b38c', '#f7b6d2',
           '#dbdb8d')
EMPTY = '#eeeeee'      # a device that holds none of the variable
MESH_FILL = '#e3ebf5'  # the bare mesh
CELL_W, CELL_H, GAP = 136, 56, 8
MARGIN = 16
TENSOR_W = 240
STAGE_GAP = 14


def device_list(ids: Sequence[int], prefix: str = 'CPU:') -> str:
  """'CPU:0, 4' or 'CPU:0-3, 6': runs of three or more ids as ranges."""
  ids = sorted(ids)
  parts, start = [], 0
  while start < len(ids):
    end = start
    while end + 1 < len(ids) and ids[end + 1] == ids[end] + 1:
      end += 1
    if end - start >= 2:
      parts.append(f'{ids[start]}-{ids[end]}')
    else:
      parts.extend(str(i) for i in ids[start:end + 1])
    start = end + 1
  return prefix + ', '.join(parts)


def index_text(index: Sequence[Sequence[int]]) -> str:
  return '[' + ', '.join(f'{start}:{stop}' for start, stop in index) + ']'


def spec_text(spec: Sequence[str]) -> str:
  return '(' + ', '.join(f"'{axis}'" for axis in spec) + ')'


def _text(x: float, y: float, text: str, *, size: int = 12, weight: str = 'normal',
          anchor: str = 'start', fill: str = '#222222', mono: bool = False,
          transform: str = '') -> str:
  family = ' font-family="monospace"' if mono else ''
  bold = ' font-weight="bold"' if weight != 'normal' else ''
  turn = f' transform="{transform}"' if transform else ''
  return (f'<text x="{x:g}" y="{y:g}" font-size="{size}"{bold}{family} '
          f'text-anchor="{anchor}" fill="{fill}"{turn}>{escape(text)}</text>')


def _rect(x: float, y: float, w: float, h: float, *, fill: str, stroke: str = '#555555',
          dashed: bool = False, width: float = 1) -> str:
  dash = ' stroke-dasharray="6 4"' if dashed else ''
  return (f'<rect x="{x:g}" y="{y:g}" width="{w:g}" height="{h:g}" fill="{fill}" '
          f'stroke="{stroke}" stroke-width="{width:g}"{dash}/>')


def _grid_place(doc: dict, device: dict) -> tuple[int, int]:
  """(row, column) of a device: columns are the last mesh axis, rows the
  others in order (as the Mesh tab draws it)."""
  sizes = [size for _, size in doc['mesh']['axes']]
  row = 0
  for coord, size in zip(device['coords'][:-1], sizes[:-1]):
    row = row * size + coord
  return row, device['coords'][-1]


def _row_label(doc: dict, device: dict) -> str:
  names = [name for name, _ in doc['mesh']['axes']][:-1]
  return ' · '.join(f'{name} {c}' for name, c in zip(names, device['coords'][:-1]))


def _mesh_words(doc: dict) -> str:
  return ' x '.join(f'{name}={size}' for name, size in doc['mesh']['axes'])


def _variable(doc: dict, path: str) -> dict:
  for variable in doc['variables']:
    if variable['path'] == path:
      return variable
  raise KeyError(f'{path} is not a variable of this mesh.json; its variables: '
                 + ', '.join(v['path'] for v in doc['variables']))


def _header(doc: dict, variable: dict | None) -> list[str]:
  """The figure's header lines, all read from the document."""
  mesh = doc['mesh']
  if variable is None:
    return [f"mesh {_mesh_words(doc)}: {mesh['num_devices']} {mesh['device_type']} devices",
            'numbered row-major over the axes; each cell: device name and its coordinates']
  lines = [variable['path']]
  shape = ', '.join(str(n) for n in variable['shape'])
  # `source`: '2: .*/ffn/w_in', '2: .*/ffn/w_in (+ fsdp over data)', 'default: replicated'
  rule = variable['source'] if variable['rule_index'] is None else f"rule {variable['source']}"
  stored = 'stored as' if variable['use_spec'] is not None else 'spec'
  lines.append(f"shape [{shape}] {variable['dtype']} · {stored} {spec_text(variable['spec'])} · "
               f'{rule}')
  held = f"{variable['bytes_per_device']:,} of {variable['bytes_total']:,} bytes per device"
  if variable['mesh']:  # a pipeline stage's sub-mesh
    held += f" that holds it, on sub-mesh {variable['mesh']}"
  if variable['use_spec'] is not None:
    held += (f" as stored; gathered to {spec_text(variable['use_spec'])} for its math: "
             f"{variable['bytes_per_device_at_use']:,}")
  lines.append(held)
  return lines


def _slice_colours(variable: dict | None) -> dict[int, tuple[str, dict]]:
  """device id -> (fill, the slice it holds), for a variable's figure; the
  same fill as the slice's block in `_tensor_panel`."""
  by_device = {}
  for k, piece in enumerate(variable['slices'] if variable is not None else ()):
    for device_id in piece['devices']:
      by_device[device_id] = (PALETTE[k % len(PALETTE)], piece)
  return by_device


def _tensor_panel(variable: dict, x0: float, y0: float) -> tuple[list[str], float]:
  """The variable itself (1-D or 2-D) cut into its slices; (svg, bottom y)."""
  shape, spec = variable['shape'], variable['spec']
  rows, cols = (1, shape[0]) if len(shape) == 1 else (shape[0], shape[1])
  width = TENSOR_W
  height = 28 if len(shape) == 1 else min(176, max(48, round(width * rows / cols)))
  out = [_text(x0, y0 - 22, f"the variable, [{', '.join(map(str, shape))}]", size=12,
               weight='bold')]
  col_dim = len(shape) - 1
  col_edges, row_edges = set(), set()
  for k, piece in enumerate(variable['slices']):
    (c0, c1) = piece['index'][col_dim]
    (r0, r1) = (0, 1) if len(shape) == 1 else piece['index'][0]
    col_edges.update((c0, c1))
    row_edges.update((r0, r1))
    x, w = x0 + width * c0 / cols, width * (c1 - c0) / cols
    y, h = y0 + height * r0 / rows, height * (r1 - r0) / rows
    out.append(_rect(x, y, w, h, fill=PALETTE[k % len(PALETTE)]))
    label = device_list(piece['devices'])
    if len(label) * 6.2 > w - 4:
      label = device_list(piece['devices'], prefix='')
    out.append(_text(x + w / 2, y + h / 2 + 4, label, size=10, anchor='middle'))
  for edge in sorted(col_edges):
    out.append(_text(x0 + width * edge / cols, y0 - 5, str(edge), size=10, anchor='middle',
                     fill='#555555'))
  if len(shape) > 1:
    for edge in sorted(row_edges):
      out.append(_text(x0 - 4, y0 + height * edge / rows + 4, str(edge), size=10, anchor='end',
                       fill='#555555'))

  def along(dim: int) -> str:
    axis = spec[dim]
    return 'whole' if axis == 'unsharded' else f"split over '{axis}'"
  bottom = y0 + height + 18
  if len(shape) == 1:
    out.append(_text(x0, bottom, f'dim 0 ({shape[0]}): {along(0)}', size=11))
  else:
    out.append(_text(x0, bottom, f'rows, dim 0 ({shape[0]}): {along(0)}', size=11))
    bottom += 16
    out.append(_text(x0, bottom, f'columns, dim 1 ({shape[1]}): {along(1)}', size=11))
  return out, bottom


def render(doc: dict, variable_path: str | None, *, source: str) -> str:
  """The SVG of one figure: `doc`'s mesh as a grid of devices and, for a
  variable, the slice each device holds (replicas share a colour) beside the
  variable cut into those slices. `source` is the caption's last line."""
  variable = None if variable_path is None else _variable(doc, variable_path)
  colours = _slice_colours(variable)
  axes = doc['mesh']['axes']
  num_cols = axes[-1][1]
  num_rows = math.prod(size for _, size in axes[:-1])
  devices = doc['devices']
  labels, row_stage = {}, {}
  for device in devices:
    row = _grid_place(doc, device)[0]
    labels.setdefault(row, _row_label(doc, device))
    row_stage.setdefault(row, device['stage'])
  label_w = max([len(text) * 7 for text in labels.values()] + [0]) + 12
  header = _header(doc, variable)
  staged = doc['mesh']['stage_axis'] is not None
  grid_x = MARGIN + label_w
  lift = 6 if staged else 0  # the axis labels, above the stage outlines
  grid_y = MARGIN + 20 * len(header) + 40 + lift
  grid_w = num_cols * CELL_W + (num_cols - 1) * GAP
  row_top, y = [], grid_y
  for row in range(num_rows):  # stages a little apart, so their outlines do not touch
    if row and row_stage.get(row) != row_stage.get(row - 1):
      y += STAGE_GAP
    row_top.append(y)
    y += CELL_H + GAP
  grid_h = y - GAP - grid_y

  body = []
  for k, line in enumerate(header):
    body.append(_text(MARGIN, MARGIN + 14 + 20 * k, line, size=15 if k == 0 else 12,
                      weight='bold' if k == 0 else 'normal', mono=k == 0 and variable is not None))
  last_axis = axes[-1][0]
  body.append(_text(grid_x + grid_w / 2, grid_y - 24 - lift,
                    f"columns: mesh axis '{last_axis}' ({num_cols})"
                    + (f" · rows: {' x '.join(repr(n) for n, _ in axes[:-1])}"
                       if len(axes) > 1 else ''), size=11, anchor='middle', fill='#555555'))
  for col in range(num_cols):
    body.append(_text(grid_x + col * (CELL_W + GAP) + CELL_W / 2, grid_y - 6 - lift,
                      f'{last_axis} {col}', size=12, anchor='middle'))
  for row, text in sorted(labels.items()):
    body.append(_text(grid_x - 10, row_top[row] + CELL_H / 2 + 4, text,
                      size=12, anchor='end'))
  for device in devices:
    row, col = _grid_place(doc, device)
    x, y = grid_x + col * (CELL_W + GAP), row_top[row]
    if variable is None:
      fill, second = MESH_FILL, 'coords (' + ', '.join(map(str, device['coords'])) + ')'
    elif device['id'] in colours:
      fill, piece = colours[device['id']]
      second = index_text(piece['index'])
    else:
      fill, second = EMPTY, 'holds none'
    body.append(f'<g id="device-{device["id"]}">')
    body.append(_rect(x, y, CELL_W, CELL_H, fill=fill))
    body.append(_text(x + CELL_W / 2, y + 22, device['name'], size=13, weight='bold',
                      anchor='middle'))
    body.append(_text(x + CELL_W / 2, y + 42, second, size=11, anchor='middle',
                      mono=variable is not None and second != 'holds none',
                      fill='#222222' if fill != EMPTY else '#777777'))
    body.append('</g>')
  if staged:
    for stage in sorted({d['stage'] for d in devices if d['stage'] is not None}):
      places = [_grid_place(doc, d) for d in devices if d['stage'] == stage]
      top, bottom = min(r for r, _ in places), max(r for r, _ in places)
      left, right = min(c for _, c in places), max(c for _, c in places)
      x, y = grid_x + left * (CELL_W + GAP) - 5, row_top[top] - 5
      w = (right - left + 1) * (CELL_W + GAP) - GAP + 10
      h = row_top[bottom] + CELL_H - row_top[top] + 10
      body.append(_rect(x, y, w, h, fill='none', stroke='#333333', dashed=True, width=1.5))
      body.append(_text(x + w + 6, y + h / 2 + 4, f'stage {stage}', size=12, weight='bold'))

  right_edge = grid_x + grid_w + (70 if staged else 0)
  bottom = grid_y + grid_h
  if variable is not None and len(variable['shape']) <= 2:
    panel_x = right_edge + 56
    panel, panel_bottom = _tensor_panel(variable, panel_x, grid_y)
    body.extend(panel)
    right_edge, bottom = panel_x + TENSOR_W, max(bottom, panel_bottom)
  caption = ['Same colour: the same slice (replicas); ranges are [start:stop] per dimension.'
             if variable is not None else
             'Device ids come from DTensor; the axis names and sizes from mesh.shape.',
             source]
  for k, line in enumerate(caption):
    body.append(_text(MARGIN, bottom + 28 + 18 * k, line, size=11, fill='#555555'))
  width = max(right_edge + MARGIN, MARGIN + 7 * max(len(line) for line in header + caption))
  height = bottom + 28 + 18 * len(caption) + MARGIN - 12
  title = header[0] if variable is None else f'{header[0]}: {header[1]}'
  return '\n'.join([
      f'<svg xmlns="http://www.w3.org/2000/svg" width="{width:g}" height="{height:g}" '
      f'viewBox="0 0 {width:g} {height:g}" font-family="sans-serif" role="img" '
      f'aria-label={quoteattr(title)}>',
      f'<title>{escape(title)}</title>',
      f'<rect x="0" y="0" width="{width:g}" height="{height:g}" fill="#ffffff"/>',
      *body, '</svg>', ''])


def figure_svg(figure: Figure, doc: dict) -> str:
  return render(doc, figure.variable,
                source=f'Drawn from the mesh.json of {RUNS[figure.run].describe()} '
                       f'({COMMAND}).')


def draw_all(out_dir: str, work_dir: str) -> list[str]:
  """Records every run under `work_dir` and writes every figure to `out_dir`;
  returns the paths written."""
  docs = record_all(work_dir)
  os.makedirs(out_dir, exist_ok=True)
  written = []
  for figure in FIGURES:
    path = os.path.join(out_dir, figure.name)
    with open(path, 'w', encoding='utf-8') as f:
      f.write(figure_svg(figure, docs[figure.run]))
    written.append(path)
  return written


def main(argv: Sequence[str]) -> None:
  # pylint: disable=import-outside-toplevel
  from layout_core import tf_internals
  from layout_core.layout.mesh import configure_virtual_cpus
  if configure_virtual_cpus(NUM_DEVICES) < NUM_DEVICES:
    raise SystemExit(f'{COMMAND} needs {NUM_DEVICES} CPU devices')
  # As in the tests' shared process: meshes of several shapes in one process.
  tf_internals.lower_gathers_once(False, reason=COMMAND)
  out_dir = argv[1] if len(argv) > 1 else IMG_DIR
  with tempfile.TemporaryDirectory() as work_dir:
    for path in draw_all(out_dir, work_dir):
      print(os.path.relpath(path))


if __name__ == '__main__':
  main(sys.argv)
