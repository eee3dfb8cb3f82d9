"""Training: the Lightning module, callbacks, loggers, precision choice, optimizers and throughput accounting."""
