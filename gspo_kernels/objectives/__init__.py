"""The objectives, one module each."""
