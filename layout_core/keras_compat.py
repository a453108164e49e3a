"""`LayoutMap`: the Keras DTensor layout map, for plain `tf.Module` models.

Behaves like Keras' `tf.keras.dtensor.experimental.LayoutMap`: a dict from
string keys to `dtensor.Layout`s where a lookup tries the exact key first and
then every key as a regex (`re.match`, i.e. anchored at the start only, as in
Keras) in insertion order, returning None when nothing matches.

    layout_map = LayoutMap(mesh=mesh)
    layout_map['d1.kernel'] = dtensor.Layout(['unsharded', 'model'], mesh)
    with layout_map.scope():
      model = SubclassModel()          # a tf.Module with attributes d1, d2
      model(tf.zeros([10, 10]))
    model.d1.kernel.layout             # the layout above

Paths are the object-attribute paths of the module tree ('d1.kernel',
'layers.0.bias'). As in Keras, variables created in the scope stay ordinary
(the model can run on plain tensors) until the model is complete: when the scope closes, every `tf.Module` bound to a local name in
the `with` block's frame (or passed to `apply`) has its variables re-laid out
by attribute path and becomes a DVariable. Models kept elsewhere can call `layout_map.apply(model)`.
meshgin's own layers use `LayoutScope` instead, which creates each variable
directly sharded.
"""

from __future__ import annotations

import collections.abc
import contextlib
import re
import sys
from typing import Iterator

import tensorflow as tf
from tensorflow.experimental import dtensor


class LayoutMap(collections.abc.MutableMapping):
  """String key (exact, then regex by insertion order) -> dtensor.Layout."""

  def __init__(self, mesh: dtensor.Mesh | None = None):
    self._layouts: dict[str, dtensor.Layout] = {}
    self._default_mesh = mesh

  def __getitem__(self, key: str) -> dtensor.Layout | None:
    if key in self._layouts:
      return self._layouts[key]
    for pattern, layout in self._layouts.items():
      if re.match(pattern, key):
        return layout
    return None

  def __setitem__(self, key: str, layout: dtensor.Layout) -> None:
    if key in self._layouts:
      raise ValueError(f"'{key}' is already in the LayoutMap (as "
                       f'{self._layouts[key]}); keys must be unique')
    if not isinstance(layout, dtensor.Layout):
      raise ValueError(f'{layout!r} must be a dtensor.Layout, got {type(layout)}')
    self._layouts[key] = layout

  def __delitem__(self, key: str) -> None:
    del self._layouts[key]

  def __len__(self) -> int:
    return len(self._layouts)

  def __iter__(self) -> Iterator[str]:
    return iter(self._layouts)

  def get_default_mesh(self) -> dtensor.Mesh | None:
    return self._default_mesh

  def layout_for(self, path: str, rank: int) -> dtensor.Layout:
    layout = self[path]
    if layout is not None:
      return layout
    if self._default_mesh is None:
      raise ValueError(f"no layout for '{path}' and the LayoutMap has no default mesh")
    return dtensor.Layout.replicated(self._default_mesh, rank=rank)

  def apply(self, module: tf.Module) -> tf.Module:
    """Re-lays out `module`'s variables by their attribute path; returns it."""
    for path, variable in module._flatten(  # pylint: disable=protected-access
        predicate=lambda v: isinstance(v, tf.Variable), with_path=True):
      object_path = '.'.join(str(p) for p in path)
      layout = self.layout_for(object_path, variable.shape.rank)
      current = getattr(variable, 'layout', None)
      if current is not None and current == layout:
        continue
      value = tf.convert_to_tensor(variable)
      if current is None:
        value = dtensor.copy_to_mesh(value, dtensor.Layout.replicated(
            layout.mesh, rank=variable.shape.rank))
      relaid = dtensor.DVariable(dtensor.relayout(value, layout),
                                 trainable=variable.trainable,
                                 name=variable.name.split(':')[0])
      _set_by_path(module, path, relaid)
    return module

  def scope(self):
    return layout_map_scope(self)


def _set_by_path(root, path, value) -> None:
  for part in path[:-1]:
    root = root[part] if isinstance(part, int) else getattr(root, part)
  if isinstance(path[-1], int):
    root[path[-1]] = value
  else:
    setattr(root, path[-1], value)


@contextlib.contextmanager
def layout_map_scope(layout_map: LayoutMap):
  """See the module docstring; `LayoutMap.scope()` returns this."""
  mesh = layout_map.get_default_mesh()
  created: list[tf.Variable] = []

  def creator(next_creator, **kwargs):
    if mesh is None:
      raise ValueError('LayoutMap.scope() needs a LayoutMap with a default mesh')
    variable = next_creator(**kwargs)
    created.append(variable)
    return variable

  caller = sys._getframe(2)  # pylint: disable=protected-access  # the `with` block
  with tf.variable_creator_scope(creator):
    yield
  created_ids = {id(v) for v in created}
  for value in list(caller.f_locals.values()):
    if isinstance(value, tf.Module) and any(
        id(v) in created_ids for v in value.variables):
      layout_map.apply(value)
