"""The emulated training run for the local GPU-less cluster (see README.md next to this file).

Nothing here touches a GPU: the memory figures it prints are modelled, and its first log
line says so. Standard library only, because it runs under the nodes' system `python3`.
"""
