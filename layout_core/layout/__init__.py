"""Where every tensor lives: the mesh, the layout rules, the scope that creates
variables directly sharded, and the multi-client cluster.

    from layout_core.layout import LayoutRules, LayoutScope, MeshSpec, build_mesh
"""

from layout_core.layout.mesh import MeshSpec, build_mesh
from layout_core.layout.rules import LayoutRules
from layout_core.layout.scope import LayoutScope, plan_layouts

__all__ = ['LayoutRules', 'LayoutScope', 'MeshSpec', 'build_mesh', 'plan_layouts']
