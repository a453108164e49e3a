"""The Mesh tab's TensorBoard plugin: routes over the logdir's mesh.json files.

Routes, under /data/plugin/meshgin/:

    index.js               the page (an ES module TensorBoard renders in an iframe)
    runs                   {"runs": [{"run": "sweep/a", "mesh": true, "problem": null}]}
    mesh?run=R             run R's mesh.json, or {"error": "no mesh.json in run 'R' ..."}
    compare?a=R1&b=R2      plugins.mesh_tab.runs.compare of two runs

The page takes `run`, `variable`, `compare` and `search` from its own query
string (`/data/plugin_entry.html?name=meshgin&run=R&variable=lm/softmax/w`)
or, inside TensorBoard, `mesh_run`, `mesh_variable`, ... from the page's.
"""

from __future__ import annotations

import os

from tensorboard.backend import http_util
from tensorboard.plugins import base_plugin
from werkzeug import wrappers

from plugins.mesh_tab import runs as runs_lib

PLUGIN_NAME = 'meshgin'  # TensorBoard's own 3-D 'mesh' plugin has that name
STATIC_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'static')


class MeshPlugin(base_plugin.TBPlugin):
  """Serves the Mesh tab (module doc)."""

  plugin_name = PLUGIN_NAME

  def __init__(self, context: base_plugin.TBContext):
    self._logdir = context.logdir
    self._active = False

  def get_plugin_apps(self):
    return {'/index.js': self._serve_page, '/runs': self._serve_runs,
            '/mesh': self._serve_mesh, '/compare': self._serve_compare}

  def is_active(self) -> bool:
    """Once any run under the logdir has a run record (then it stays on)."""
    if not self._active and self._logdir and os.path.isdir(self._logdir):
      self._active = bool(runs_lib.find_runs(self._logdir))
    return self._active

  def frontend_metadata(self) -> base_plugin.FrontendMetadata:
    return base_plugin.FrontendMetadata(es_module_path='/index.js', tab_name='Mesh')

  @wrappers.Request.application
  def _serve_page(self, request):
    with open(os.path.join(STATIC_DIR, 'index.js'), encoding='utf-8') as f:
      return http_util.Respond(request, f.read(), 'text/javascript')

  @wrappers.Request.application
  def _serve_runs(self, request):
    listed = []
    runs = runs_lib.find_runs(self._logdir) if self._logdir else []
    for run in runs:  # one walk of the logdir, not one per run
      try:
        runs_lib.read_mesh(self._logdir, run, runs=runs)
        listed.append({'run': run, 'mesh': True, 'problem': None})
      except runs_lib.MeshDataError as e:
        listed.append({'run': run, 'mesh': False, 'problem': str(e)})
    return http_util.Respond(request, {'logdir': self._logdir, 'runs': listed},
                             'application/json')

  def _read(self, run: str | None) -> dict:
    if not run:
      raise runs_lib.MeshDataError('no run given (?run=NAME)')
    return runs_lib.read_mesh(self._logdir, run)

  @wrappers.Request.application
  def _serve_mesh(self, request):
    try:
      document = self._read(request.args.get('run'))
    except runs_lib.MeshDataError as e:
      return http_util.Respond(request, {'error': str(e)}, 'application/json', code=404)
    return http_util.Respond(request, document, 'application/json')

  @wrappers.Request.application
  def _serve_compare(self, request):
    try:
      result = runs_lib.compare(self._read(request.args.get('a')),
                                self._read(request.args.get('b')))
    except runs_lib.MeshDataError as e:
      return http_util.Respond(request, {'error': str(e)}, 'application/json', code=404)
    return http_util.Respond(request, result, 'application/json')
