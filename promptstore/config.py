"""Settings: one typed table with defaults, documented once, readable from the
environment (PROMPTSTORE_<NAME>, e.g. PROMPTSTORE_HOT_BYTES=1073741824)."""

from __future__ import annotations

import os
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator

from .errors import SettingsError

GiB = 1 << 30
ENV_PREFIX = "PROMPTSTORE_"


class Settings(BaseModel):
    """How a store keeps its snapshots."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    hot_bytes: int = Field(
        2 * GiB, ge=0, description="memory budget of the hot tier (per process); 0 keeps nothing hot"
    )
    disk_bytes: int = Field(32 * GiB, ge=0, description="disk budget of the cold tier, brought back by evicting leaves")
    durability: Literal["write_back", "write_through", "sync"] = Field(
        "write_back",
        description="write_back: spill on eviction and close; write_through: queue every insert for disk; "
        "sync: insert returns once the node is on disk",
    )
    checkpoint_interval: int | None = Field(
        None,
        ge=1,
        description="grid of checkpoints while prefilling, for models with window or recurrent layers "
        "(default: prefill_step, a state at every prefill chunk boundary)",
    )
    prefill_step: int = Field(512, ge=1, description="tokens per forward while prefilling")
    writer_queue: int = Field(64, ge=1, description="spill jobs queued before inserts wait")
    fsync: bool = Field(True, description="fsync files and directories before publishing them")
    file_mode: int = Field(0o600, description="permissions of snapshot files")
    dir_mode: int = Field(0o700, description="permissions of store directories")
    map_size: int = Field(64 << 20, ge=1 << 16, description="initial LMDB map size; it grows when full")

    @field_validator("file_mode", "dir_mode")
    @classmethod
    def _owner_keeps_access(cls, mode: int, info: ValidationInfo) -> int:
        # Files: the owner reads and writes; directories: also lists and enters.
        need = 0o600 if info.field_name == "file_mode" else 0o700
        if not 0 <= mode <= 0o777 or mode & need != need:
            raise ValueError(f"{oct(mode)}: a permission mode (at most 0o777) that includes {oct(need)}")
        return mode

    @classmethod
    def from_env(cls, **overrides: Any) -> Settings:
        """Defaults, then PROMPTSTORE_* variables, then `overrides`."""
        values: dict[str, Any] = {}
        for name in cls.model_fields:
            raw = os.environ.get(ENV_PREFIX + name.upper())
            if raw is not None:
                try:
                    values[name] = int(raw, 0) if name.endswith("_mode") else raw
                except ValueError:
                    raise SettingsError(f"{ENV_PREFIX}{name.upper()}={raw!r}: not a number (e.g. 0o600)") from None
        values.update(overrides)
        try:
            return cls.model_validate(values)
        except ValidationError as e:
            problems = "; ".join(f"{'.'.join(map(str, err['loc'])) or 'settings'}: {err['msg']}" for err in e.errors())
            raise SettingsError(f"invalid settings: {problems}") from None
