"""Where checkpoint bytes go and how a step commits (local filesystem)."""
