"""The seed-compatibility APIs, kept public for users of the originals:

* `layout_map.LayoutMap` / `layout_map_scope`: Keras' DTensor `LayoutMap`
  (exact key, then `re.match` in insertion order) for `tf.Module` models;
* `replicated.ReplicatedVariable` / `replicated_scope`: the TPU replicated
  variable, one identical copy per device.

meshgin's own path is `layout_core.layout.LayoutRules` (first `re.fullmatch`
wins) applied by `LayoutScope`.
"""
