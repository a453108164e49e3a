"""Checkpoints of other frameworks in and out of meshgin.

    from layout_core.convert import hf
    source = hf.open_hf('downloads/llama')   # Hugging Face config.json + safetensors
    source.kwargs                            # transformer_lm(**kwargs)
    dict(source.values())                    # variable path -> value (one at a time)

`hf` (Llama, Mistral, Qwen2, GPT-2) is built from `hf_config` (config.json
<-> transformer_lm's kwargs), `hf_names` (tensor names <-> variable paths)
and `hf_files` (safetensors read and written one tensor at a time).
`launch.import_hf` and `launch.export --format=hf` are the commands
(`plugins.hf` builds the run around them). Nothing here imports TensorFlow.
"""
