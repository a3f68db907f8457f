"""The gradient kernels that train stacked clients, and the per-client loop they are compared with."""
