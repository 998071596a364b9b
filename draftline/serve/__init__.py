"""serve's library: the target with its draft in vLLM, measured in child processes, and `make serve`'s command."""
