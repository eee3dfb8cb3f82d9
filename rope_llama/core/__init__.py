"""What the rooms below share: the checkpoint format and safe loading (checkpoint.py), one check for
numbers (checks.py), devices (device.py), precision and inference dtypes (precision.py), torch's threads
(threads.py) and the memory budget (memory.py)."""
