"""Prometheus metrics: what the record holds, read at scrape time (`record`), what only the
running daemon knows (`series`), and the two ways they are served (`serve`): the daemon's own
listener (`[metrics] listen`, `settings`) and the web server's /metrics."""
