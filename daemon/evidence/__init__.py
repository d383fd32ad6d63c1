"""Evidence about a failed job: pure parsers of logs, messages and node state; the probe runner."""
