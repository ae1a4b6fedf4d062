"""Option values: the error a value that cannot be used raises, and the values with a structure
of their own (a pinned layout, Slurm's signal, the metrics endpoint), each of which parses its
text form and names the fix when it cannot.

The options that hold them are declared in :mod:`elasticft.config`; :mod:`elasticft.options`
reads them from flags, ``ELASTICFT_*`` variables and the YAML file.
"""

from __future__ import annotations

import dataclasses
import signal
from datetime import timedelta
from typing import Any


class ConfigError(ValueError):
    """A user-supplied option is unusable; ``reason`` is machine-readable."""

    def __init__(self, message: str, reason: str = "bad_option") -> None:
        super().__init__(message)
        self.reason = reason



def bad_value(source: str, value: Any, fix: str) -> ConfigError:
    """The one-line error of a value ``value`` from ``source`` that cannot be used, naming the
    fix."""
    return ConfigError(f"{source}={value!r} is not valid; {fix}", reason="bad_option")


@dataclasses.dataclass(frozen=True)
class PinnedLayout:
    """A 3D-parallel layout; ``None`` for a dimension left to the planner."""

    tp: int | None = None
    pp: int | None = None
    dp: int | None = None

    FIX = ("give --layout TP,PP,DP as three whole numbers >= 1, with * for a dimension left to "
           "the planner, e.g. 2,*,*")

    @classmethod
    def parse(cls, value: Any, source: str = "--layout") -> PinnedLayout:
        if isinstance(value, PinnedLayout):
            return value
        parts = [p.strip() for p in str(value).split(",")]
        if len(parts) != 3:
            raise bad_value(source, value, cls.FIX)
        sizes: list[int | None] = []
        for part in parts:
            if part == "*":
                sizes.append(None)
            elif part.isdigit() and int(part) >= 1:
                sizes.append(int(part))
            else:
                raise bad_value(source, value, cls.FIX)
        return cls(*sizes)

    def complete(self) -> tuple[int, int, int] | None:
        """(tp, pp, dp) when every dimension is given, else None."""
        if self.tp is None or self.pp is None or self.dp is None:
            return None
        return self.tp, self.pp, self.dp

    def __str__(self) -> str:
        return ",".join("*" if v is None else str(v) for v in (self.tp, self.pp, self.dp))


def parse_signal_name(name: str, source: str = "--slurm-signal") -> signal.Signals:
    """A signal by name (``USR1``, ``SIGUSR1``) or number, as sbatch --signal takes it."""
    text = str(name).strip().upper()
    if text.isdigit():
        try:
            return signal.Signals(int(text))
        except ValueError:
            pass
    elif text:
        try:
            return signal.Signals[text if text.startswith("SIG") else "SIG" + text]
        except KeyError:
            pass
    raise ConfigError(
        f"{source}={name!r} is not a signal; give the one of sbatch --signal, e.g. USR1@120",
        reason="bad_option",
    )


@dataclasses.dataclass(frozen=True)
class SlurmSignal:
    """sbatch's ``--signal=[B:]SIG[@SECONDS]``: which signal, and how long before the limit."""

    signal: signal.Signals = signal.SIGUSR1
    lead_time: timedelta = timedelta(seconds=120)
    batch_only: bool = False
    """``B:``: Slurm signals only the batch shell (which the launcher runs in), not job steps."""

    FIX = "give sbatch's [B:]SIG[@SECONDS], e.g. USR1@120 or B:USR1@300"

    @classmethod
    def parse(cls, value: Any, source: str = "--slurm-signal") -> SlurmSignal:
        if isinstance(value, SlurmSignal):
            return value
        text = str(value).strip()
        batch_only = text.upper().startswith("B:")
        if batch_only:
            text = text[2:]
        name, at, seconds = text.partition("@")
        lead = 60  # sbatch's own default lead time
        if at:
            if not seconds.strip().isdigit() or int(seconds) < 1:
                raise bad_value(source, value, cls.FIX)
            lead = int(seconds)
        try:
            sig = parse_signal_name(name, source)
        except ConfigError:
            raise bad_value(source, value, cls.FIX) from None
        return cls(sig, timedelta(seconds=lead), batch_only)

    def __str__(self) -> str:
        name = self.signal.name.removeprefix("SIG")
        return f"{'B:' if self.batch_only else ''}{name}@{self.lead_time.total_seconds():g}"


@dataclasses.dataclass(frozen=True)
class MetricsEndpoint:
    """Where the Prometheus metrics endpoint listens."""

    host: str = "127.0.0.1"
    port: int = 0

    FIX = ("give [HOST:]PORT with a port from 1 to 65535 (e.g. 9100 or 0.0.0.0:9100), or off")

    @classmethod
    def parse(cls, value: Any, source: str = "--diag-metrics") -> MetricsEndpoint | None:
        if value is None or isinstance(value, MetricsEndpoint):
            return value
        if value is False or str(value).strip().lower() in ("", "off", "none"):
            return None
        text = str(value).strip()
        host, colon, port = text.rpartition(":")
        host = host.strip("[]") if colon else cls.host
        if not port.isdigit() or not 1 <= int(port) <= 65535 or (colon and not host):
            raise bad_value(source, value, cls.FIX)
        return cls(host, int(port))

    def __str__(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"
