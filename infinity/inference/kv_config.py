"""How the KV cache of ``generate`` is offloaded: where its layers wait, and the budget.

Kept free of transformers so that ``infinity`` imports without it; the cache itself is in
:mod:`infinity.inference.kv_cache`.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from infinity.config import AioConfig, check_keys, parse_size
from infinity.errors import ConfigError
from swap.files import check_directory

#: where the layers wait between uses
KV_TARGETS = ("host", "nvme")


@dataclass(frozen=True)
class KVOffloadConfig:
    """target: ``host`` keeps the layers that wait in host RAM; ``nvme`` writes them to swap
        files under ``nvme_path`` through the swap engine. Each layer comes back on the
        compute device when its attention runs, prefetched one layer ahead, and leaves again
        right after: at most two layers' K/V are on the device at once.
    budget: bytes of K/V the compute device holds at once (the layer computing and the one
        prefetched). A layer whose K/V alone exceed it raises :class:`BudgetError`; two that do
        not fit together are fetched one at a time (``stats()["prefetch_skipped"]``). With
        ``nvme``, host memory holds up to four staging buffers of that size (touched as used).
    nvme_path: the swap directory for ``nvme`` (must exist and be writable).
    max_segments: tokens written after a layer's last full write are appended as segments;
        after this many the layer is written whole again, so a read stays a few requests.
    aio: how the swap engine issues I/O (``nvme`` only).
    verify_checksums: checksums on what is written and read back (``nvme`` only).
    """

    target: str = "host"
    budget: int = 256 << 20
    nvme_path: Path | None = None
    max_segments: int = 16
    aio: AioConfig = AioConfig()
    verify_checksums: bool = True

    def __post_init__(self) -> None:
        if self.target not in KV_TARGETS:
            close = difflib.get_close_matches(str(self.target), KV_TARGETS, n=1)
            hint = f"did you mean {close[0]!r}?" if close else "pick one of them"
            raise ConfigError(
                f"kv offload target={self.target!r} is invalid: expected one of "
                f"{', '.join(map(repr, KV_TARGETS))}; {hint}",
                field="target",
            )
        budget = self.budget
        if isinstance(budget, str):
            budget = parse_size(budget, name="budget")
        if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
            raise ConfigError(
                f"kv offload budget={self.budget!r} is invalid: expected a positive byte count "
                f"such as 268435456 or '256MiB'",
                field="budget",
            )
        object.__setattr__(self, "budget", budget)
        if (
            isinstance(self.max_segments, bool)
            or not isinstance(self.max_segments, int)
            or self.max_segments < 1
        ):
            raise ConfigError(
                f"kv offload max_segments={self.max_segments!r} is invalid: expected a "
                f"positive integer such as 16",
                field="max_segments",
            )
        if not isinstance(self.aio, AioConfig):
            raise ConfigError(
                f"kv offload aio must be an AioConfig, got {type(self.aio).__name__}", field="aio"
            )
        if not isinstance(self.verify_checksums, bool):
            raise ConfigError(
                f"kv offload verify_checksums must be true or false, got {self.verify_checksums!r}",
                field="verify_checksums",
            )
        if self.nvme_path is not None:
            object.__setattr__(self, "nvme_path", Path(self.nvme_path).expanduser())
        if self.target == "nvme":
            self._check_nvme_path()

    def _check_nvme_path(self) -> None:
        if self.nvme_path is None:
            raise ConfigError(
                "kv offload target='nvme' needs nvme_path: a writable directory on the drive "
                "that will hold the cache's swap files (or use target='host')",
                field="nvme_path",
            )
        # Missing, a file, read-only or not writable: said as such. Anything subtler fails
        # where the swap engine makes its run directory, with NvmePathError too.
        object.__setattr__(self, "nvme_path", check_directory(self.nvme_path))

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> KVOffloadConfig:
        """The config from a mapping; an unknown key raises naming the closest valid one."""
        check_keys(data, [f.name for f in fields(cls)], "kv offload config")
        values = dict(data)
        if isinstance(values.get("aio"), Mapping):
            check_keys(values["aio"], [f.name for f in fields(AioConfig)], "kv offload aio")
            values["aio"] = AioConfig(**values["aio"])
        return cls(**values)


def for_store(
    aio: AioConfig,
    verify_checksums: bool,
    nvme_paths: tuple[Path, ...],
    device_budget: int,
    target: str,
    budget: int | str | None,
    options: Mapping[str, Any],
) -> KVOffloadConfig:
    """The KV cache's config beside a store: ``target`` ('host' or 'nvme', swapping under the
    store's first ``nvme_paths`` directory with its ``aio`` settings), within ``budget`` bytes
    on the device (default: a quarter of the store's ``device_budget``, where it has one);
    ``options`` are the other fields."""
    settings: dict[str, Any] = {"aio": aio, "verify_checksums": verify_checksums}
    if target == "nvme" and nvme_paths:
        settings["nvme_path"] = nvme_paths[0]
    if budget is None and device_budget:
        budget = device_budget // 4
    if budget is not None:
        settings["budget"] = budget
    settings.update(options, target=target)
    return KVOffloadConfig.from_dict(settings)
