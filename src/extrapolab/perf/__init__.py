"""Speed and memory: the benchmark (`extrapolab bench`) and the one memory sampler."""
