"""The project's own inputs: tiny random targets, the embedded data."""
