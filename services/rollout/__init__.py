"""Rollout service: generates completions for the trainer from the current policy."""
