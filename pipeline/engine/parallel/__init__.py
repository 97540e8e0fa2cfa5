"""Tensor-parallel replicas: a target split over ranks (shard.py), their group (group.py), and rank 0
driving every rank's steps (steps.py)."""
