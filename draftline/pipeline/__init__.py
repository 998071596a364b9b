"""The machinery around the stages: config, stamps, manifests, dependencies, launch."""
