"""Make's command-line tools, above the library: ``status`` (stamps, staleness, the assets
and the rehearsal's wait Make asks about when it parses), ``init`` (a user's own target) and
``reproduce`` (a run replayed from its manifests). Nothing in the library imports them."""
