"""Generated gRPC stubs for the rlfleet.v1 contract (run `python -m services.api.codegen`)."""
