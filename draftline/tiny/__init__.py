"""The project's own inputs: tiny random targets, the trained tiny target, the embedded data."""
