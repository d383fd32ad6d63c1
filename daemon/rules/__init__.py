"""The diagnosis's rules: `dispatch.diagnose` asks them in the runbooks' order, each reading one
`context.RuleContext`; `hardware` (faults and co-tenants) and `device_oom` (the device's memory)
are the two long ones. The records they give are `daemon.diagnosis`'s."""
