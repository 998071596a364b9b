"""Make's command-line tools, above the library: ``status`` (stamps, staleness, the assets
and the rehearsal's wait Make asks about when it parses), ``init`` (a user's own target),
``reproduce`` (a run replayed from its manifests) and ``trained_target`` (`make target`: the
tiny target trained on the embedded corpus). Nothing in the library imports them."""
