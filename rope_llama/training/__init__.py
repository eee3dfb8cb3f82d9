"""Training: the Lightning module (module.py), callbacks, the text sample at each validation included
(callbacks.py), optimizers and schedules (optim.py), torch.compile's choice (compile.py), loggers,
run directories and their lock (run_dir.py), trainer option checks and throughput accounting. Precision
is core/'s."""
