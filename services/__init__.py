"""rlfleet: reinforcement-learning post-training for LLMs as gRPC microservices."""

__version__ = "0.1.0"
