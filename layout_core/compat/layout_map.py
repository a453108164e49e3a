"""`LayoutMap`: the Keras DTensor layout map, for plain `tf.Module` models.

Behaves like Keras' `tf.keras.dtensor.experimental.LayoutMap`: a dict from
string keys to `dtensor.Layout`s where a lookup tries the exact key first and
then every key as a regex (`re.match`, i.e. anchored at the start only, as in
Keras) in insertion order, returning None when nothing matches.

    layout_map = LayoutMap(mesh=mesh)
    layout_map['d1.kernel'] = dtensor.Layout(['unsharded', 'model'], mesh)
    with layout_map.scope() as scope:
      model = scope.track(SubclassModel())   # a tf.Module with attributes d1, d2
    y = model(x)                             # weights created now, laid out
    model.d1.kernel.layout                   # the layout above

Paths are the object-attribute paths of the module tree ('d1.kernel',
'layers.0.bias'). As the Keras seed documents, "weight creation within or
outside of the scope works":

  * weights created inside the scope (e.g. a first call on plain tensors)
    stay ordinary until the scope closes; then every tracked module's
    variables are re-laid out by attribute path and become DVariables;
  * weights a tracked module creates after the scope has closed (a lazy
    build on its first call) are born as replicated DVariables on the map's
    mesh, so the call runs on DTensor inputs, and are re-laid out by path
    as soon as that call returns.

`scope.track(module)` is the explicit handle that replaces the seed's hidden
bookkeeping: it gives the module's class a `__call__` that routes later
variable creation through the map (the object, its attributes and
`isinstance` checks are unchanged). Models kept elsewhere can call
`layout_map.apply(model)`. meshgin's own layers use `LayoutScope` instead,
which creates each variable directly sharded.
"""

from __future__ import annotations

import collections.abc
import re
from typing import Iterator

from absl import logging

from layout_core.lazy import dtensor, tf
from layout_core.layout.variables import creator_initial_value


class LayoutMap(collections.abc.MutableMapping):
  """String key (exact, then regex by insertion order) -> dtensor.Layout."""

  def __init__(self, mesh: 'dtensor.Mesh | None' = None):
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

  def scope(self) -> 'LayoutMapScope':
    return LayoutMapScope(self)

  def replicated_variable(self, creator_kwargs: dict) -> tf.Variable:
    """A variable-creator's request, made as a DVariable replicated on the mesh."""
    if self._default_mesh is None:
      raise ValueError('creating variables through a LayoutMap needs a default mesh')
    value = creator_initial_value(creator_kwargs)
    layout = dtensor.Layout.replicated(self._default_mesh, rank=value.shape.rank)
    return dtensor.DVariable(dtensor.copy_to_mesh(value, layout),
                             trainable=creator_kwargs.get('trainable', True) is not False,
                             name=creator_kwargs.get('name'))


def _set_by_path(root, path, value) -> None:
  for part in path[:-1]:
    root = root[part] if isinstance(part, int) else getattr(root, part)
  if isinstance(path[-1], int):
    root[path[-1]] = value
  else:
    setattr(root, path[-1], value)


class LayoutMapScope:
  """What `with layout_map.scope() as scope:` gives: `scope.track(module)`."""

  def __init__(self, layout_map: LayoutMap):
    self.layout_map = layout_map
    self.tracked: list[tf.Module] = []
    self.active = False
    self._created: list[tf.Variable] = []
    self._context = None

  def track(self, module: 'tf.Module') -> 'tf.Module':
    """Lays `module` out when the scope closes, and any variable it creates
    later on first use (see the module docstring). Returns `module`."""
    if self.layout_map.get_default_mesh() is None:
      raise ValueError('LayoutMap.scope() needs a LayoutMap with a default mesh')
    module.__class__ = _laid_out_class(type(module))
    module._meshgin_layout_scope = self  # pylint: disable=protected-access
    self.tracked.append(module)
    return module

  def _record(self, next_creator, **kwargs):
    variable = next_creator(**kwargs)
    self._created.append(variable)
    return variable

  def __enter__(self) -> 'LayoutMapScope':
    self.active = True
    self._context = tf.variable_creator_scope(self._record)
    self._context.__enter__()
    return self

  def __exit__(self, *exc) -> None:
    self._context.__exit__(*exc)
    self.active = False
    if exc[0] is not None:
      return
    for module in self.tracked:
      self.layout_map.apply(module)
    laid_out = {id(v) for m in self.tracked for v in m.variables}
    stray = [v.name for v in self._created
             if not isinstance(v, dtensor.DVariable) and id(v) not in laid_out]
    if stray:
      logging.warning('%d variable(s) created in LayoutMap.scope() belong to no tracked '
                      'module and stay unsharded (%s): use scope.track(model)',
                      len(stray), ', '.join(stray[:5]))


_LAID_OUT_CLASSES: dict[type, type] = {}


def _laid_out_class(cls: type) -> type:
  """`cls` with a `__call__` that creates late variables through the map."""
  if getattr(cls, '_meshgin_laid_out', False):
    return cls
  if cls not in _LAID_OUT_CLASSES:
    def __call__(self, *args, **kwargs):
      scope = self._meshgin_layout_scope  # pylint: disable=protected-access
      if scope.active:  # inside the `with`: created plain, laid out on exit
        return cls.__call__(self, *args, **kwargs)
      created = []

      def creator(next_creator, **creator_kwargs):
        del next_creator
        variable = scope.layout_map.replicated_variable(creator_kwargs)
        created.append(variable)
        return variable

      with tf.variable_creator_scope(creator):
        outputs = cls.__call__(self, *args, **kwargs)
      if created:
        scope.layout_map.apply(self)
      return outputs

    _LAID_OUT_CLASSES[cls] = type(cls.__name__, (cls,), {
        '__call__': __call__, '__module__': cls.__module__,
        '__qualname__': cls.__qualname__, '__doc__': cls.__doc__,
        '_meshgin_laid_out': True,
        '_TF_MODULE_IGNORED_PROPERTIES': frozenset(
            getattr(cls, '_TF_MODULE_IGNORED_PROPERTIES', frozenset())
            | {'_meshgin_layout_scope'})})
  return _LAID_OUT_CLASSES[cls]
