"""Models: the Params layer framework (`base`), the library's layers
(`layers`), the weights their math reads (`weights`), step randomness
(`random`), the LM recipes (`lm`) and the Keras 3 adapter (`keras`, imported
on its own: it loads Keras).

    from layout_core import model
    p = model.transformer_lm_params(num_layers=2)
    model.num_parameters(p)
"""

from layout_core.model.base import (BaseLayer, Declared, LayerMeta, Sequential,
                                    flatten_layers, leaf_layers, leaf_modules,
                                    num_parameters)
from layout_core.model.weights import LayerWeights, Weights, dense
from layout_core.model.attention import MultiHeadAttention, attention
from layout_core.model.layers import (Dropout, Embedding, FeedForward, LayerNorm, Softmax,
                                      TransformerBlock)
from layout_core.model.lm import (moe_feed_forward_params, transformer_block_params,
                                  transformer_lm_params)
from layout_core.model.moe import MoEFeedForward
from layout_core.model.random import current_random, random_context, step_seed

__all__ = ['BaseLayer', 'Declared', 'Dropout', 'Embedding', 'FeedForward', 'LayerMeta',
           'LayerNorm', 'LayerWeights', 'MoEFeedForward', 'MultiHeadAttention', 'Sequential', 'Softmax',
           'TransformerBlock', 'Weights', 'attention', 'current_random', 'dense',
           'flatten_layers', 'leaf_layers', 'leaf_modules', 'moe_feed_forward_params', 'num_parameters', 'random_context',
           'step_seed', 'transformer_block_params', 'transformer_lm_params']
