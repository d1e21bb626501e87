"""The on-disk format: JSON manifest + raw buffers; never pickle."""
