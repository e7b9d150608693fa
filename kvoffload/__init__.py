"""The framework's core, below every system: kernels (mechanism), the model, the seam between the model and a
KV-cache system (`kv`), what every offloading system shares (`offload`) and the decode loop (`generate`)."""
