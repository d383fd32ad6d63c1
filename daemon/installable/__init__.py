"""What an operator installs outside the package, shipped in it: one copy of each.

`node_probe` (each compute node's SSH forced command) and `epilog` (slurmctld's
EpilogSlurmctld hook) are programs of the standard library alone, so they run where
slurm-medic is not installed: `slurm-medic install node-probe|epilog` writes the module's file
as it is, and the console scripts `medic-node-probe` and `slurm-medic-epilog` run their
`main`. The systemd units and `config.example.toml` are package data, written by
`slurm-medic install units|config` (see daemon/commands/install.py). Nothing here imports
beyond the standard library, `daemon/__init__` included.
"""
