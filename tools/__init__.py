"""Developer tools for cupy-amp (kernel compile check, benchmarks); not shipped in the wheel."""
