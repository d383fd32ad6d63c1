"""The fleet sweep: every node judged before a job dies on it, drained or resumed on policy.

`findings` (pure) turns a node probe into findings and a health; `node_policy` (pure) decides
drain, wait or record, and when a drained node may return; `schedule` (pure) spreads the
sweep over its interval; `sweep` does the I/O (Slurm, the prober, the record).
"""
