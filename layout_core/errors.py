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
  """A user-fixable configuration problem: what was wrong, where, and the fix.

  Raise it from your own layers and tasks for a setting the user can change;
  the launchers print its one paragraph and exit with status 2.

      raise ConfigError(f'{p.name}.activation is {p.activation!r}',
                        where=f'{p.name}.activation', fix="use 'relu' or 'gelu'")
      # "gated.activation is 'tanh'. Where: gated.activation. Fix: use 'relu' or 'gelu'."
  """

  def __init__(self, message: str, *, where: str | None = None,
               fix: str | None = None):
    """Composes the message: `message.`, then `Where: ...` and `Fix: ...`.

    Args:
      message: What is wrong, with the values involved.
      where: The setting or place to change (`gated_dense.output_dim`),
        kept as `self.where`.
      fix: What to do instead, kept as `self.fix`.

    `self.message` keeps `message` alone, to say again with another
    `where` and `fix` (`ConfigError(e.message, where=..., fix=...)`).
    """
    parts = [message.rstrip('.') + '.']
    if where:
      parts.append(f'Where: {where}.')
    if fix:
      parts.append(f'Fix: {fix.rstrip(".")}.')
    super().__init__(' '.join(parts))
    self.message = message.rstrip('.')
    self.where = where
    self.fix = fix
