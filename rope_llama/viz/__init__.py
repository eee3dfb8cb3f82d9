"""What scripts/visualize.py draws: RoPE's geometry for every scaling (geometry.py), the model's own attention
on one window reduced to maps and curves (attention_maps.py), and the figures of both (plots.py)."""
