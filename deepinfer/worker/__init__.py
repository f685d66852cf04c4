"""The model runner: owns the device, the weights and the KV tensors; executes plans."""
