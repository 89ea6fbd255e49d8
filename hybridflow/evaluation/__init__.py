"""Evaluation of trained models outside the trainer (held-out problems, intervals)."""
