"""The engine: sharding, collectives, hooks and the per-model operations the faces use; one module per concern."""
