"""The real training run for the local cluster: PyTorch and transformers on CPU over gloo.

Everything the daemon reads is real (ranks, collectives, DCP checkpoints, tracebacks, hangs,
cgroup kills) except the CUDA OOM itself, which is injected where the emulator's memory
model says it happens. See README.md.
"""
