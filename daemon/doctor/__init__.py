"""`slurm-medic doctor`: whether slurm-medic can work on this host, item by item.

The stages read as the command: `gather` asks the config, the record, Slurm, a node, the
sockets through the project's seams, each within its own time limit and never stopping
another; `facts` is what it found; `judge` turns facts into ok / warn / fail lines with what
to do, and is pure.
"""
