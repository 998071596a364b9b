"""`make rehearse`: the run's engine code on a miniature of its target, and the run's cost."""
