"""Connections per window by decision, as the geometry of a server-side SVG stacked bar chart.

Server-side SVG needs no script (the Content-Security-Policy stays strict) and reads the rollup the
API returns grouped by `window` and `decision`; each bar carries a <title> a pointer or a screen
reader can read."""

from __future__ import annotations

from dataclasses import dataclass

from controlplane.console.chips import parse_instant

DECISIONS = ("allowed", "observed", "would_block", "blocked")
WIDTH, HEIGHT, LEFT, BOTTOM, TOP = 720, 200, 48, 24, 8
DEFAULT_WINDOW_SECONDS = 60


@dataclass(frozen=True)
class Bar:
    x: float
    y: float
    width: float
    height: float
    decision: str
    title: str


@dataclass(frozen=True)
class Plot:
    bars: list[Bar]
    peak: int
    first: str
    last: str
    totals: dict[str, int]
    width: int = WIDTH
    height: int = HEIGHT
    left: int = LEFT
    plot_bottom: int = HEIGHT - BOTTOM

    @property
    def empty(self) -> bool:
        return not self.bars


def connections_plot(rows: list[dict], *, start: str, end: str) -> Plot:
    """`rows`: rollup items with `window_start`, `decision` and `connection_count`, over [start, end):
    each window is placed where it lies in the range, so quiet stretches show as empty space."""
    windows: dict[str, dict[str, int]] = {}
    totals = dict.fromkeys(DECISIONS, 0)
    for row in rows:
        per = windows.setdefault(row["window_start"], dict.fromkeys(DECISIONS, 0))
        per[row["decision"]] += row["connection_count"]
        totals[row["decision"]] += row["connection_count"]
    begin, finish = parse_instant(start), parse_instant(end)
    if not windows or begin is None or finish is None or finish <= begin:
        return Plot([], 0, start, end, totals)
    instants = sorted((parse_instant(key), key) for key in windows)
    gaps = [(b[0] - a[0]).total_seconds() for a, b in zip(instants, instants[1:], strict=False)]
    length = min([g for g in gaps if g > 0] or [DEFAULT_WINDOW_SECONDS])
    span = (finish - begin).total_seconds()
    scale = (WIDTH - LEFT) / span
    peak = max(sum(per.values()) for per in windows.values()) or 1
    usable = HEIGHT - BOTTOM - TOP
    bars = []
    for instant, key in instants:
        x = LEFT + max(0.0, (instant - begin).total_seconds()) * scale
        width = max(length * scale * 0.85, 2.0)
        base = HEIGHT - BOTTOM
        for decision in DECISIONS:
            count = windows[key][decision]
            if not count:
                continue
            height = usable * count / peak
            base -= height
            bars.append(
                Bar(
                    x=round(min(x, WIDTH - width), 2),
                    y=round(base, 2),
                    width=round(width, 2),
                    height=round(height, 2),
                    decision=decision,
                    title=f"{key}: {count} {decision.replace('_', '-')}",
                )
            )
    return Plot(bars, peak, start, end, totals)
