"""Training state: flattening, staging copies, rebuilding, RNG."""
