"""extract's library: target hidden states into resumable safetensors shards."""
