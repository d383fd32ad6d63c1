"""Alembic migrations of the record; a package so an installed slurm-medic can find them."""
