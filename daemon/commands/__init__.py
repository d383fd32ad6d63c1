"""The CLI's command groups, one module per area; `daemon.cli` registers them."""
