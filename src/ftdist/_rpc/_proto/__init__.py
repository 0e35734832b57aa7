"""Generated protobuf modules (``make proto`` rewrites every file here but this one)."""
