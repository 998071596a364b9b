"""evaluate's library: the offline walk, the draft rollout, statistics, the vLLM check."""
