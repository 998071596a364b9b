"""regenerate's library: the target's own greedy replies in place of the data's."""
