"""The one exception type that means "the configuration is wrong".

Library code raises `ConfigError` for anything a user can fix by editing a
config (a mesh bigger than the machine, a layout rule that does not fit a
variable, a micro-batch count that does not divide the batch). The launchers
turn it into a one-paragraph message and exit code 2; anything else is a bug
and keeps its traceback.

    raise ConfigError("mesh 2x4=8 needs 8 devices but 6 are visible",
                      fix="set mesh.shape to use at most 6 devices")
"""

from __future__ import annotations


class ConfigError(ValueError):
  """A user-fixable configuration problem: what was wrong, where, and the fix."""

  def __init__(self, message: str, *, where: str | None = None,
               fix: str | None = None):
    parts = [message.rstrip('.') + '.']
    if where:
      parts.append(f'Where: {where}.')
    if fix:
      parts.append(f'Fix: {fix.rstrip(".")}.')
    super().__init__(' '.join(parts))
    self.where = where
    self.fix = fix
