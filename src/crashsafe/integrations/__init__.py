"""Glue for the frameworks people train with: ``crashsafe.integrations.lightning`` (PyTorch Lightning)
and ``crashsafe.integrations.transformers`` (Hugging Face). Each imports its framework; this package
imports neither. See docs/integrations.md."""
