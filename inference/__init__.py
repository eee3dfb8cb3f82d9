"""Inference-side helpers shared by generate.py and the scripts (see DESIGN.md): the memory budget."""
