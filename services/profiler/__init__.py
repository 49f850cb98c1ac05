"""The profiler service: progress reports in, throughput and convergence models out."""
