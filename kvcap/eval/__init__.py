"""Evaluation: corpora (calibration/evaluation splits with provenance), tasks, A/B harness."""
