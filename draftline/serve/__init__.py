"""serve's library: `make serve`'s `vllm serve` of the run's target with its draft."""
