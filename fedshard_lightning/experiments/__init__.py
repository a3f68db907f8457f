"""Experiments of the paper (cascaded leaving, poisoning) built on the trainer."""
