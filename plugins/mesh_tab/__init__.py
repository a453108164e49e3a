"""TensorBoard's Mesh tab: how a meshgin run's parameters are sharded.

`pip install -e .` registers `plugin.MeshPlugin` under the `tensorboard_plugins`
entry point (pyproject.toml), so `tensorboard --logdir runs/` shows a "Mesh"
tab: the device mesh as a grid coloured by the bytes each device holds, the
layout rules and what each decided, a searchable variable table (a selected
variable marks the slice each device holds), and two runs compared.

Its data is each run's `mesh.json`, written by `launch.train`
(`plugins.record.mesh_document`) next to `layouts.txt`; `runs` reads and
compares them without TensorFlow, `plugin` serves them with the page in
`static/` (plain HTML/JS/SVG, no build step).
"""

MESH_JSON = 'mesh.json'
MESH_JSON_FORMAT = 1
