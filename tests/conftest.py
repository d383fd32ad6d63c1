"""Shared pytest configuration: the plugins that bring up real services for marked tests."""

pytest_plugins = ["tests.postgres", "tests.devcluster"]
