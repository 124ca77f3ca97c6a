"""A parameter's declared metadata: its shard spec (sharding), the per-parameter record every
layer declares (params), and where its weight gradient goes (weight_grad)."""
