"""The SGLang rollout engine: an adapter over SGLang's HTTP API (client), the SGLang child process
it may run (process), and the `GenerationEngine` the rollout service sees (engine)."""
