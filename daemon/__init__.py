"""slurm-medic: the GPU out-of-memory runbook for Slurm clusters, as a service."""

from __future__ import annotations

__version__ = "0.1.0"
