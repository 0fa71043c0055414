"""What the training loop and the backends share: optimizer and LR schedule, precision policy,
loss, checkpoint files, process-group utilities, device readings (below parallel/ and train/).
"""
