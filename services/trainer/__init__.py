"""The trainer service: owns the policy (and its ref / old_actor / teacher copies) and trains it.

One gRPC server per trainer rank; a backend does forward/backward and the optimizer step; the
memory lifecycle (sleep, wake, host store) keeps weights readable for sync at all times; the loss
functions are plain torch over response-token tensors. Nothing here imports the coordinator or
the rollout service.
"""
