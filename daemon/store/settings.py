"""The record's settings; the top-level Settings nests this model."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, field_validator

DEFAULT_STATE_DIR = Path("/var/lib/slurm-medic")


def sqlite_url(path: Path) -> str:
    """A SQLAlchemy URL for a SQLite file; the path is absolute so the cwd never matters."""
    return f"sqlite+pysqlite:///{path.absolute()}"


class StoreSettings(BaseModel):
    """Where the record lives and how the engine pools connections to it."""

    url: str = Field(
        default=sqlite_url(DEFAULT_STATE_DIR / "medic.db"),
        description="SQLAlchemy URL: sqlite+pysqlite:///PATH or postgresql+psycopg://...",
    )
    echo: bool = False
    pool_size: int = Field(default=5, ge=1)
    max_overflow: int = Field(default=5, ge=0)
    pool_timeout_s: float = Field(default=30.0, gt=0)
    sqlite_busy_timeout_ms: int = Field(default=5000, ge=0)

    model_config = ConfigDict(frozen=True, extra="forbid")

    @field_validator("url")
    @classmethod
    def _known_backend(cls, url: str) -> str:
        if not url.startswith(("sqlite", "postgresql")):
            raise ValueError("the record supports sqlite and postgresql URLs only")
        return url
