"""Training: what the Lightning run needs beyond the plain network (precision choice, optimizers)."""
