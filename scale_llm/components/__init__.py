"""What the training loop and the backends share: checkpoint file reading, ..."""
