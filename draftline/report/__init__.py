"""report's library: one HTML page of a run and its figures."""
