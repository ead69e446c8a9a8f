"""Connections per window by decision, as the geometry of a server-side SVG stacked bar chart.

Server-side SVG needs no script (the Content-Security-Policy stays strict) and reads the rollup the
API returns grouped by `window` and `decision`; each bar carries a <title> a pointer or a screen
reader can read."""

from __future__ import annotations

from dataclasses import dataclass

from controlplane.console.chips import parse_instant

DECISIONS = ("allowed", "observed", "would_block", "blocked")
WIDTH, HEIGHT, LEFT, BOTTOM, TOP = 720, 200, 48, 24, 8


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


def connections_plot(rows: list[dict]) -> Plot:
    """`rows`: rollup items with `window_start`, `decision` and `connection_count`."""
    windows: dict[str, dict[str, int]] = {}
    totals = dict.fromkeys(DECISIONS, 0)
    for row in rows:
        per = windows.setdefault(row["window_start"], dict.fromkeys(DECISIONS, 0))
        per[row["decision"]] += row["connection_count"]
        totals[row["decision"]] += row["connection_count"]
    order = sorted(windows, key=lambda start: parse_instant(start) or start)
    if not order:
        return Plot([], 0, "", "", totals)
    peak = max(sum(windows[start].values()) for start in order) or 1
    slot = (WIDTH - LEFT) / len(order)
    usable = HEIGHT - BOTTOM - TOP
    bars = []
    for index, start in enumerate(order):
        base = HEIGHT - BOTTOM
        for decision in DECISIONS:
            count = windows[start][decision]
            if not count:
                continue
            height = usable * count / peak
            base -= height
            bars.append(
                Bar(
                    x=round(LEFT + index * slot + slot * 0.1, 2),
                    y=round(base, 2),
                    width=round(max(slot * 0.8, 1), 2),
                    height=round(height, 2),
                    decision=decision,
                    title=f"{start}: {count} {decision.replace('_', '-')}",
                )
            )
    return Plot(bars, peak, order[0], order[-1], totals)
