"""StarTrail for Megatron-Bridge users, in one line of a recipe::

    from megatron_startrail.bridge import startrail_layer_spec

    cfg = vanilla_gpt_pretrain_config()                      # any GPT recipe's ConfigContainer
    cfg.model.context_parallel_size = 4
    cfg.model.transformer_layer_spec = startrail_layer_spec(team_size=2)

Bridge resolves ``transformer_layer_spec`` after it has made its process groups
(``GPTModelProvider.provide``), which is when the StarTrail groups can be built. See
``docs/bridge.md`` for what composes and what is refused. Importing this package does not
import Megatron-Bridge; the layer spec imports its default spec only when asked for it.
"""

from .layer_spec import StarTrailLayerSpec, startrail_layer_spec

__all__ = ["StarTrailLayerSpec", "startrail_layer_spec"]
