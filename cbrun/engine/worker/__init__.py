"""The worker: the model runner, its persistent batch, step inputs, CUDA graphs and async batching, the device."""
