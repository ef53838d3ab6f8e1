"""Device-side CuTe DSL helpers, inlined into kernels when traced (no host code, no torch)."""
