"""Opt-in speed paths: each is a drop-in for a plain op of model/, checked against it (see DESIGN.md)."""
