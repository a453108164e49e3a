r"""Import a Hugging Face checkpoint (Llama, Mistral, Qwen2, GPT-2) as a meshgin run.

  python -m launch.import_hf --hf_dir=downloads/Llama-3.2-1B --model_dir=runs/llama
  python -m launch.import_hf --hf_dir=downloads/Llama-3.2-1B --model_dir=runs/llama-tp \
      --gin_file=configs/layouts/megatron.gin \
      --gin_bindings="mesh.shape = {'data': 2, 'model': 4}"

--hf_dir is a directory as Hugging Face's `save_pretrained` (or a hub
download) leaves it: config.json, model.safetensors or the shards of
model.safetensors.index.json (float32, bfloat16 or float16), and the
tokenizer (tokenizer.json or tokenizer.model, with their config files).
The model family comes from config.json's model_type; a setting meshgin
does not implement (a sliding window shorter than the context, experts,
RoPE scaling other than Llama 3's, another activation) is refused, naming it.

--model_dir becomes a run like any other: config.gin (transformer_lm's
arguments, the Markov task at the model's vocabulary, the mesh and layout of
--gin_file / --gin_bindings: one device by default), a step-0 checkpoint
written on that mesh in that layout, and tokenizer/. Then:

  python -m launch.decode --model_dir=runs/llama --prompt='The capital of France is'
  python -m launch.eval   --model_dir=runs/llama
  python -m launch.export --model_dir=runs/llama --format=hf --export_dir=exports/llama-hf
  python -m launch.train  --gin_file=runs/llama/config.gin --model_dir=runs/llama \
      --gin_file=my_data.gin        # fine-tunes from step 0 on your data

--peft_dir adds LoRA adapters saved by PEFT (or by launch.export
--adapters_only) to the run: its config binds lora.* to theirs, and the
checkpoint holds them beside the base weights (docs/fine-tune.md).

Tied embeddings stay tied (transformer_lm.tie_embeddings = True in its
config): the softmax reads lm/emb/table, and the export writes one matrix.

Exit status: 0 imported; 2 a configuration error in one paragraph (a missing,
truncated or unknown file or tensor, a field meshgin does not implement, a
--model_dir that exists and is not empty without --overwrite, bindings that
change the architecture), with nothing written; 1 a crash, with its
traceback, nothing written either (the run is written beside --model_dir
and renamed into place).
"""

from __future__ import annotations

if __name__ == '__main__':  # first, before the imports below take their time
  import launch
  launch.install_start_up_handlers()

from absl import app, flags, logging

from launch import gin_flags

flags.adopt_module_key_flags(gin_flags)  # --gin_file / --gin_bindings: mesh and layout

HF_DIR = flags.DEFINE_string(
    'hf_dir', None, 'Required. The Hugging Face model directory: config.json, '
    'model.safetensors (or model.safetensors.index.json and its shards), tokenizer files.')
MODEL_DIR = flags.DEFINE_string(
    'model_dir', None, 'Required. The run to create (a new or empty directory, unless '
    '--overwrite).')
PEFT_DIR = flags.DEFINE_string(
    'peft_dir', None, 'LoRA adapters Hugging Face PEFT saved for that model '
    '(adapter_config.json, adapter_model.safetensors; launch.export --adapters_only writes '
    'them too): the run carries them, its config binding lora.* to their settings.')
WEIGHTS_DTYPE = flags.DEFINE_enum(
    'weights_dtype', 'auto', ['auto', 'float32', 'bfloat16'],
    'What the run\'s step-0 checkpoint stores the weights in. auto: bfloat16 when every '
    'weight in the checkpoint is BF16 (bit for bit, half the bytes of float32; a run '
    'reading them into float32 weights widens them exactly), else float32.')
OVERWRITE = flags.DEFINE_bool(
    'overwrite', False, 'Replace what --model_dir holds (it is replaced only once the new '
    'run is complete).')


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'unexpected arguments: {argv[1:]}')
  logging.set_verbosity(logging.INFO)

  def body(watcher):
    # pylint: disable=g-import-not-at-top
    from layout_core.errors import ConfigError
    from plugins import hf
    if not HF_DIR.value:
      raise ConfigError('--hf_dir is not given', where='the command line',
                        fix='add --hf_dir=<a Hugging Face model directory>')
    if not MODEL_DIR.value:
      raise ConfigError('--model_dir is not given', where='the command line',
                        fix='add --model_dir=runs/<name> (a new directory)')
    hf.return_freed_memory_promptly()
    report = hf.import_run(hf_dir=HF_DIR.value, model_dir=MODEL_DIR.value,
                           files=gin_flags.GIN_FILES.value,
                           bindings=gin_flags.GIN_BINDINGS.value,
                           search_paths=gin_flags.GIN_SEARCH_PATHS.value,
                           overwrite=OVERWRITE.value, on_write=watcher.defer,
                           peft_dir=PEFT_DIR.value, weights_dtype=WEIGHTS_DTYPE.value)
    print(report.line(), flush=True)

  gin_flags.run_guarded(body)


if __name__ == '__main__':
  app.run(main, flags_parser=launch.parse_flags)
