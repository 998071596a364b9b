"""train's library: data loader, the EAGLE-3 draft, checkpoints, the loop."""
