"""The target with its draft in vLLM, shared by evaluate, rehearse, serve, benchmarks, harness:
decode jobs measured in child processes (``jobs``) and the `vllm serve` command line."""
