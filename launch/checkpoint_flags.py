"""The flags of the launchers that read a trained run: which checkpoint, which config.

    from launch import checkpoint_flags
    flags.adopt_module_key_flags(checkpoint_flags)
    files = checkpoint_flags.config_files()   # the run's config.gin, then --gin_file

Used by launch.eval, launch.decode, launch.export and launch.lm_eval.
"""

from __future__ import annotations

from absl import flags

from launch import gin_flags

MODEL_DIR = flags.DEFINE_string(
    'model_dir', None, 'The run\'s directory: its newest complete checkpoint is read, with '
    'its config.gin. Read only.')
CHECKPOINT = flags.DEFINE_string(
    'checkpoint', None, 'A checkpoint to read instead of the newest: a ckpt-N directory or '
    'its prefix (.../ckpt-N/ckpt). Its own config.gin is the run\'s config.')
RUN_CONFIG = flags.DEFINE_bool(
    'run_config', True, 'Start from the run\'s config.gin (then --gin_file, --gin_bindings); '
    '--norun_config: only the --gin_file files given.')


def config_files() -> list[str]:
  """The gin files these flags name (`plugins.inference.config_files`)."""
  from plugins import inference  # pylint: disable=g-import-not-at-top
  return inference.config_files(model_dir=MODEL_DIR.value, checkpoint=CHECKPOINT.value,
                                gin_files=gin_flags.GIN_FILES.value,
                                from_run=RUN_CONFIG.value)
