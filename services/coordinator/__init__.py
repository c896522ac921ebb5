"""The coordinator: runs RL jobs over trainer and rollout servers, and serves the job API."""
