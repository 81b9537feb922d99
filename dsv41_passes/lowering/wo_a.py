"""wo_a fused ops (namespace ``dsv41``): custom ops, fake implementations, reference providers."""
