"""The models: finding, loading and vetting them (loading), their forward over slots (attention), CPU kernels."""
