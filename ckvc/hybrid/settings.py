"""``.ckvc/hybrid.json`` (docs/FORMAT.md section 19): whether a repository is a
lazy clone, its promisor remotes, its cache budget and its auto_push remote. Read
by fetch and pull (a lazy clone fetches metadata only) and by the hybrid cache;
below the remote layer, so both can."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

from ckvc.core import Repository
from ckvc.errors import InvalidConfigError

SETTINGS_KEY = "hybrid.json"
SETTINGS_VERSION = 1


@dataclass
class HybridSettings:
    """``.ckvc/hybrid.json``: absent means a plain repository (everything local,
    no budget, no background push)."""

    version: int = SETTINGS_VERSION
    lazy: bool = False  # made by clone --lazy: chunks arrive on first read
    promisors: list[str] = field(default_factory=list)  # remotes asked for absent chunks, in order
    cache_size: int | None = None  # bytes of local packs the cache keeps (None: no limit)
    auto_push: str | None = None  # remote each commit is pushed to in the background

    @property
    def active(self) -> bool:
        return self.lazy or self.cache_size is not None or bool(self.promisors) or self.auto_push is not None

    @classmethod
    def load(cls, core: Repository) -> HybridSettings:
        data = core.refs.backend.get(SETTINGS_KEY)
        if data is None:
            return cls()
        try:
            raw = json.loads(data.decode("utf-8"))
            if raw.get("version") != SETTINGS_VERSION:
                raise InvalidConfigError(f"{SETTINGS_KEY}: unknown version {raw.get('version')!r}")
            settings = cls(**{k: raw[k] for k in cls.__dataclass_fields__ if k in raw})
            if not isinstance(settings.promisors, list) or not all(isinstance(p, str) for p in settings.promisors):
                raise TypeError("promisors must be a list of remote names")
            if settings.cache_size is not None and (
                isinstance(settings.cache_size, bool) or not isinstance(settings.cache_size, int)
            ):
                raise TypeError("cache_size must be an integer or null")
            return settings
        except (ValueError, TypeError, AttributeError) as exc:
            raise InvalidConfigError(f"{SETTINGS_KEY} is damaged: {exc}") from None

    def save(self, core: Repository) -> None:
        body = json.dumps(asdict(self), indent=2, sort_keys=True) + "\n"
        core.refs.backend.put(SETTINGS_KEY, body.encode())
