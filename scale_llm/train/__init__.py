"""The training loop and what it is made of: optimizer, precision, checkpoints, metrics."""
