"""The record: SQLAlchemy models, the engine factory, the JSON codec and repository functions.

Nothing here opens a database at import; callers make an engine with `make_engine`.
"""
