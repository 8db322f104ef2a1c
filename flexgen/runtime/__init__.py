"""Running kernels: input checks, tile tables and autotuning, launching, ahead-of-time compiles."""
