"""From a lowered mod to a loaded kernel module: the printer, the spec, rendering, the cache."""
