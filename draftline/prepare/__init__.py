"""prepare's library: the shards checked and split by sample into the trainer's index."""
