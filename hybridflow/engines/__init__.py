"""Engines: training engines (`engines.training`) and rollout engines (`engines.rollout`)."""
