"""Building blocks of distributed training, each parallelism in its own module.

Nothing here knows a particular model: the per-model code in `meshtrain.models`
says how to shard and stage one.
"""
