"""How a model is spread over devices: device choice, activation checkpointing, backends."""
