"""Training: the Lightning module, callbacks, precision choice, optimizers and throughput accounting."""
