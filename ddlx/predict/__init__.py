"""Performance and memory models."""
