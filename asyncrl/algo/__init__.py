"""Pure algorithm functions over `[batch, T]` tensors with masks: sampling, advantages, losses."""
