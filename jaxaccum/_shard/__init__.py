"""``shard_value_and_grad``: the window per device under ``shard_map``, its
sums reduced once."""
