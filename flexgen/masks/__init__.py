"""Block-sparse masks: the BlockMask, its builder, interval bounds, element evaluation, pictures."""
