"""Using a trained model: evaluation, decoding, export.

    from layout_core.infer import CachedLM, Sampling
    lm = CachedLM(params, variables)                 # a Transformer LM's weights by path
    lm.generate(prompts, lengths, max_new_tokens=32, sampling=Sampling(temperature=0.8))

Modules: `decode` (CachedLM: the forward pass and decoding with a KV cache),
`sampling` (Sampling, the counter-based sampler), `tokens` (text <-> ids for
a run's task), `text_samples` (train.sample_every), `evaluate` (a
checkpoint's evaluation). Importing this package does not import TensorFlow.
"""

from layout_core.infer.decode import DONE, CachedLM, lm_layers
from layout_core.infer.sampling import Sampling, sample
from layout_core.infer.tokens import tokenizer_for

__all__ = ['CachedLM', 'DONE', 'Sampling', 'lm_layers', 'sample', 'tokenizer_for']
