"""torch.nn building blocks the models are written in."""
