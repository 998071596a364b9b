"""draftline: a reproducible pipeline that trains EAGLE-3 draft models."""
