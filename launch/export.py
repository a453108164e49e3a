r"""Export a trained model as a SavedModel that loads with TensorFlow alone.

  python -m launch.export --model_dir=runs/quickstart --export_dir=exports/quickstart/1

Reads the newest complete checkpoint of the run in --model_dir (or the one
--checkpoint names), whatever mesh, layout or pipeline wrote it, rebuilds the
model from the run's config.gin (then any --gin_file and --gin_bindings) on
plain variables on one device, and writes a SavedModel with no DTensor op in
it:

  serving_default   LM: tokens int32 [batch, seq_len] -> logits float32
                    [batch, seq_len, vocab]; other tasks: the model's inputs
                    -> predictions
  generate          LM: prompts int32 [batch, prompt_len], lengths int32
                    [batch] -> tokens int32 [batch, max_new_tokens], the
                    cached decoder's loop in the graph (greedy, or
                    --temperature, --top_k, --top_p and a seed input)

The export directory appears whole or not at all (written beside it under a
temporary name, checked, renamed). --tflite also converts the signatures
for TensorFlow Lite, into `model.tflite` inside it.

--format=hf writes a Hugging Face model directory instead (a transformer_lm
run whose options match Llama, Qwen2 or GPT-2): config.json, the weights as
safetensors (--hf_dtype; sharded over --max_shard_mb, with
model.safetensors.index.json) and the run's tokenizer files (an imported
run's), read from the checkpoint one variable at a time:

  python -m launch.export --model_dir=runs/llama --format=hf --export_dir=exports/llama-hf

Exit status: 0 exported; 2 a configuration error, one paragraph (no
checkpoint, the export directory exists, a config that is not the
checkpoint's model, TFLite cannot convert); 1 a crash, with its traceback.
Nothing is left behind in either failure, and nothing is written under
--model_dir.
"""

from __future__ import annotations

if __name__ == '__main__':  # first, before the imports below take their time
  import launch
  launch.install_start_up_handlers()

import os

from absl import app, flags, logging

from launch import checkpoint_flags, gin_flags, sampling_flags

flags.adopt_module_key_flags(gin_flags)  # show the gin flags in --help
flags.adopt_module_key_flags(checkpoint_flags)
flags.adopt_module_key_flags(sampling_flags)  # LM: generate's; sampling adds a seed input
MODEL_DIR, CHECKPOINT = checkpoint_flags.MODEL_DIR, checkpoint_flags.CHECKPOINT

EXPORT_DIR = flags.DEFINE_string(
    'export_dir', None, 'Required. The SavedModel directory to create (TF Serving reads '
    '<model>/<version>/, e.g. exports/lm/1). It must not exist, unless --overwrite.')
OVERWRITE = flags.DEFINE_bool(
    'overwrite', False, 'Replace an earlier export at --export_dir.')
SEQ_LEN = flags.DEFINE_integer(
    'seq_len', None, "LM: serving_default's token positions (default: the task's "
    'seq_len; at most transformer_lm.max_len).', lower_bound=1)
PROMPT_LEN = flags.DEFINE_integer(
    'prompt_len', None, "LM: generate's prompt positions (default: seq_len - "
    'max_new_tokens); each prompt\'s own length is an input.', lower_bound=1)
MAX_NEW_TOKENS = flags.DEFINE_integer(
    'max_new_tokens', 32, 'LM: tokens generate decodes after each prompt.', lower_bound=1)
FORMAT = flags.DEFINE_enum(
    'format', 'saved_model', ['saved_model', 'hf'], "saved_model: a TensorFlow SavedModel; "
    "hf: a Hugging Face directory (config.json, safetensors, tokenizer) that transformers' "
    'AutoModelForCausalLM loads.')
HF_DTYPE = flags.DEFINE_enum(
    'hf_dtype', 'auto', ['auto', 'float32', 'bfloat16'], '--format=hf: the weights\' dtype. '
    'auto: the dtype the checkpoint holds the model\'s matrices in (a bfloat16 import, or '
    'a LoRA run on it, exports bfloat16; LoRA updates are merged in float32 first), '
    'float32 for float32 or int8 ones; float32 keeps float32 weights exactly.')
MAX_SHARD_MB = flags.DEFINE_integer(
    'max_shard_mb', 5000, '--format=hf: the largest safetensors file, in MB (10^6 bytes); '
    'larger models are sharded, with model.safetensors.index.json.', lower_bound=1)
ADAPTERS_ONLY = flags.DEFINE_bool(
    'adapters_only', False, "--format=hf: a LoRA run's adapters alone, as Hugging Face "
    "PEFT saves them (adapter_config.json, adapter_model.safetensors), for PeftModel or "
    'launch.import_hf --peft_dir. Without it the adapters are merged into the weights '
    '(both formats).')
TFLITE = flags.DEFINE_bool(
    'tflite', False, 'Also convert the signatures with TensorFlow Lite, built-in ops '
    'only (<export_dir>/model.tflite).')


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'unexpected arguments: {argv[1:]}')
  logging.set_verbosity(logging.INFO)

  def body(watcher):
    del watcher  # nothing is written before the export is complete
    # pylint: disable=g-import-not-at-top
    from layout_core.errors import ConfigError
    from layout_core.infer import export
    from plugins import gin_setup, inference, plan
    if not EXPORT_DIR.value:
      raise ConfigError('--export_dir is not given', where='the command line',
                        fix='add --export_dir=exports/<name>/1 (a new directory)')
    if FORMAT.value == 'hf':
      from plugins import hf  # pylint: disable=g-import-not-at-top
      written = hf.export_run(
          export_dir=EXPORT_DIR.value, model_dir=MODEL_DIR.value, checkpoint=CHECKPOINT.value,
          files=checkpoint_flags.config_files(), bindings=gin_flags.GIN_BINDINGS.value,
          search_paths=gin_flags.GIN_SEARCH_PATHS.value, overwrite=OVERWRITE.value,
          dtype=HF_DTYPE.value, max_shard_bytes=MAX_SHARD_MB.value * 10**6,
          adapters_only=ADAPTERS_ONLY.value)
      print(f'Exported {written["checkpoint"]} (step {written["step"]}) as a Hugging Face '
            f'{written["family"]} model to {EXPORT_DIR.value}: {", ".join(written["files"])}'
            f'{" (tied embeddings)" if written["tied"] else ""}', flush=True)
      return
    if ADAPTERS_ONLY.value:
      raise ConfigError('--adapters_only writes the Hugging Face PEFT format',
                        where='--adapters_only', fix='add --format=hf')
    sampling = sampling_flags.sampling()  # a bad flag exits 2 before the model loads
    export.check_target(EXPORT_DIR.value, overwrite=OVERWRITE.value)
    step, prefix = inference.find_checkpoint(model_dir=MODEL_DIR.value,
                                             checkpoint=CHECKPOINT.value)
    with gin_setup.parsed_config(files=checkpoint_flags.config_files(),
                                 bindings=gin_flags.GIN_BINDINGS.value,
                                 search_paths=gin_flags.GIN_SEARCH_PATHS.value):
      run_plan = plan.make_plan(data_splits=())  # an export reads no data
    model = export.load_plain_model(run_plan.params, task=run_plan.task, prefix=prefix,
                                    compute_dtype=run_plan.train.compute_dtype,
                                    moved_base=run_plan.checkpoint.moved_base)
    if model.is_lm():
      seq_len = SEQ_LEN.value or model.input_specs[0][0][1]
      signatures = export.lm_signatures(
          model, seq_len=seq_len, prompt_len=PROMPT_LEN.value,
          max_new_tokens=MAX_NEW_TOKENS.value, decoder=export.cached_decoder(model),
          sampling=sampling)
    else:
      signatures = export.task_signatures(model)
    record = export.export_saved_model(
        model, signatures, export_dir=EXPORT_DIR.value, overwrite=OVERWRITE.value,
        about={'checkpoint': os.path.abspath(prefix), 'step': step},
        tflite=TFLITE.value)
    print(export.describe(record, export_dir=EXPORT_DIR.value, checkpoint=prefix), flush=True)

  gin_flags.run_guarded(body)


if __name__ == '__main__':
  app.run(main, flags_parser=launch.parse_flags)
