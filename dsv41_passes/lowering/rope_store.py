"""rope_store fused ops (namespace ``dsv41``): custom ops, fake implementations, reference providers."""
