"""Small process-level utilities shared by the training entry point and the benchmarks."""
