"""The states of a mask block (``BlockMask.block_states``, the builder, the bounds)."""
EMPTY, PARTIAL, FULL, UNDECIDED = 0, 1, 2, 3
