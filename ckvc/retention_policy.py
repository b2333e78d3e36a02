"""Retention policies as data: the keep rules, their parsing and their form in the
config. Pure (config.py validates a stored policy with it); which commits a policy
keeps is worked out over a repository in retention.py.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass
from typing import Any

from ckvc.errors import InvalidInputError

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(s|m|h|d|w)?\s*$")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_duration(text: str) -> float:
    """Seconds in "90", "45s", "30m", "12h", "7d" or "2w"."""
    m = _DURATION.match(text)
    if m is None:
        raise InvalidInputError(f"not a duration: {text!r} (use e.g. 45s, 30m, 12h, 7d, 2w)")
    return float(m.group(1)) * _UNIT_S[m.group(2) or "s"]


_SIZE_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1000, "kib": 1 << 10, "m": 1 << 20, "mb": 1000**2,
               "mib": 1 << 20, "g": 1 << 30, "gb": 1000**3, "gib": 1 << 30, "t": 1 << 40, "tb": 1000**4,
               "tib": 1 << 40}  # fmt: skip


def parse_size(text: str) -> int | None:
    """``50GiB``, ``500MB``, ``1.5g``, ``123`` bytes; ``none``/``unlimited``: None."""
    t = text.strip().lower().replace(" ", "")
    if t in ("none", "unlimited", "off", ""):
        return None
    number = t.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = t[len(number) :]
    try:
        value = float(number)
    except ValueError:
        raise InvalidInputError(f"not a size: {text!r} (e.g. 50GiB, 500MB, unlimited)") from None
    if unit not in _SIZE_UNITS or value < 0 or not math.isfinite(value):
        raise InvalidInputError(f"not a size: {text!r} (e.g. 50GiB, 500MB, unlimited)")
    return int(value * _SIZE_UNITS[unit])


def format_size(n: float) -> str:
    """Bytes as policies and plans print them (1024-based, as parse_size reads them)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def format_duration(seconds: float) -> str:
    for unit in ("w", "d", "h", "m"):
        if seconds >= _UNIT_S[unit] and seconds % _UNIT_S[unit] == 0:
            return f"{int(seconds // _UNIT_S[unit])}{unit}"
    return f"{seconds:g}s"


@dataclass(frozen=True)
class KeepBest:
    metric: str
    mode: str  # "min" or "max"
    count: int

    def __post_init__(self) -> None:
        if not isinstance(self.metric, str) or not self.metric:
            raise InvalidInputError(f"keep-best needs a metric name, got {self.metric!r}")
        if self.mode not in ("min", "max"):
            raise InvalidInputError(f"keep-best mode must be 'min' or 'max', got {self.mode!r}")
        _positive(self.count, "keep-best count")

    @classmethod
    def parse(cls, text: str) -> KeepBest:
        parts = text.rsplit(":", 2)
        if len(parts) != 3 or parts[1] not in ("min", "max") or not parts[0]:
            raise InvalidInputError(f"--keep-best takes METRIC:min|max:N, got {text!r}")
        try:
            count = int(parts[2])
        except ValueError:
            raise InvalidInputError(f"--keep-best count must be an integer, got {parts[2]!r}") from None
        return cls(parts[0], parts[1], count)

    def __str__(self) -> str:
        return f"{self.metric}:{self.mode}:{self.count}"


def _positive(value: int, what: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise InvalidInputError(f"{what} must be a positive integer, got {value!r}")
    return value


@dataclass(frozen=True)
class RetentionPolicy:
    keep_last: int | None = None
    keep_best: tuple[KeepBest, ...] = ()
    keep_every: int | None = None
    keep_within_s: float | None = None
    branches: tuple[str, ...] | None = None  # None: every branch
    auto: bool = False  # apply after every commit
    # Keep, beyond the other rules, the newest commits whose data fits in this many bytes.
    max_size: int | None = None

    def __post_init__(self) -> None:
        if self.keep_last is not None:
            _positive(self.keep_last, "keep-last")
        if self.keep_every is not None:
            _positive(self.keep_every, "keep-every")
        if self.keep_within_s is not None and not (self.keep_within_s > 0 and math.isfinite(self.keep_within_s)):
            raise InvalidInputError(f"keep-within must be a positive duration, got {self.keep_within_s!r}")
        if self.max_size is not None and (isinstance(self.max_size, bool) or not isinstance(self.max_size, int)
                                          or self.max_size < 0):  # fmt: skip
            raise InvalidInputError(f"max-size must be a number of bytes, got {self.max_size!r}")
        if not (self.keep_last or self.keep_best or self.keep_every or self.keep_within_s or self.max_size is not None):
            raise InvalidInputError("a retention policy needs at least one keep rule")

    def describe(self) -> str:
        rules = []
        if self.keep_last:
            rules.append(f"keep-last {self.keep_last}")
        rules += [f"keep-best {b}" for b in self.keep_best]
        if self.keep_every:
            rules.append(f"keep-every {self.keep_every}")
        if self.keep_within_s:
            rules.append(f"keep-within {format_duration(self.keep_within_s)}")
        if self.max_size is not None:
            rules.append(f"max-size {format_size(self.max_size)}")
        if self.branches is not None:
            rules.append(f"branches {','.join(self.branches)}")
        return ", ".join(rules)

    def to_config(self) -> dict[str, Any]:
        out = asdict(self)
        out["keep_best"] = [str(b) for b in self.keep_best]
        out["branches"] = list(self.branches) if self.branches is not None else None
        if self.max_size is None:  # absent unless used: configs written before it stay as they were
            del out["max_size"]
        return out

    @classmethod
    def from_config(cls, raw: dict[str, Any]) -> RetentionPolicy:
        branches = raw.get("branches")
        return cls(
            keep_last=raw.get("keep_last"),
            keep_best=tuple(KeepBest.parse(b) for b in raw.get("keep_best") or ()),
            keep_every=raw.get("keep_every"),
            keep_within_s=raw.get("keep_within_s"),
            branches=tuple(branches) if branches is not None else None,
            auto=bool(raw.get("auto", False)),
            max_size=raw.get("max_size"),
        )
