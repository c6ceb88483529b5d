"""A line plot as a standalone SVG file (standard library only).

The orchestrator has no plotting library (it runs in the small bootstrap venv),
and an SVG diff reads well in review; one chart type is all the report needs:
throughput against batch size, batch sizes on a log2 axis.
"""

from __future__ import annotations

import math
from html import escape

COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b")
WIDTH, HEIGHT = 720, 440
LEFT, RIGHT, TOP, BOTTOM = 80, 190, 50, 60


def _nice_max(value: float) -> float:
    if value <= 0:
        return 1.0
    exp = 10 ** math.floor(math.log10(value))
    for step in (1, 2, 2.5, 5, 10):
        if value <= step * exp:
            return step * exp
    return 10 * exp


def line_plot(series: dict[str, dict[int, float]], title: str, x_label: str, y_label: str) -> str:
    """``series``: name -> {x (a power of two): y}. Returns the SVG text."""
    xs = sorted({x for points in series.values() for x in points})
    y_max = _nice_max(max((y for p in series.values() for y in p.values()), default=1.0))
    plot_w, plot_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM
    lo, hi = math.log2(xs[0]), math.log2(xs[-1]) if len(xs) > 1 else math.log2(xs[0]) + 1

    def px(x: float) -> float:
        return LEFT + (math.log2(x) - lo) / (hi - lo) * plot_w

    def py(y: float) -> float:
        return TOP + plot_h - y / y_max * plot_h

    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" '
        f'viewBox="0 0 {WIDTH} {HEIGHT}" font-family="sans-serif" font-size="12">',
        f'<rect width="{WIDTH}" height="{HEIGHT}" fill="white"/>',
        f'<text x="{LEFT + plot_w / 2}" y="25" text-anchor="middle" font-size="15">'
        f"{escape(title)}</text>",
    ]
    for i in range(6):
        y = y_max * i / 5
        out.append(
            f'<line x1="{LEFT}" y1="{py(y):.1f}" x2="{LEFT + plot_w}" y2="{py(y):.1f}" '
            'stroke="#ddd"/>'
        )
        out.append(f'<text x="{LEFT - 8}" y="{py(y) + 4:.1f}" text-anchor="end">{y:g}</text>')
    for x in xs:
        out.append(
            f'<line x1="{px(x):.1f}" y1="{TOP}" x2="{px(x):.1f}" y2="{TOP + plot_h}" '
            'stroke="#eee"/>'
        )
        out.append(f'<text x="{px(x):.1f}" y="{TOP + plot_h + 18}" text-anchor="middle">{x}</text>')
    out += [
        f'<line x1="{LEFT}" y1="{TOP + plot_h}" x2="{LEFT + plot_w}" y2="{TOP + plot_h}" '
        'stroke="black"/>',
        f'<line x1="{LEFT}" y1="{TOP}" x2="{LEFT}" y2="{TOP + plot_h}" stroke="black"/>',
        f'<text x="{LEFT + plot_w / 2}" y="{HEIGHT - 18}" text-anchor="middle">'
        f"{escape(x_label)}</text>",
        f'<text x="20" y="{TOP + plot_h / 2}" text-anchor="middle" '
        f'transform="rotate(-90 20 {TOP + plot_h / 2})">{escape(y_label)}</text>',
    ]
    for i, (name, points) in enumerate(series.items()):
        color = COLORS[i % len(COLORS)]
        coords = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in sorted(points.items()))
        out.append(f'<polyline points="{coords}" fill="none" stroke="{color}" stroke-width="2"/>')
        for x, y in sorted(points.items()):
            out.append(f'<circle cx="{px(x):.1f}" cy="{py(y):.1f}" r="3.5" fill="{color}"/>')
        ly = TOP + 10 + 22 * i
        lx = LEFT + plot_w + 15
        out.append(
            f'<line x1="{lx}" y1="{ly}" x2="{lx + 24}" y2="{ly}" stroke="{color}" '
            'stroke-width="2"/>'
        )
        out.append(f'<text x="{lx + 30}" y="{ly + 4}">{escape(name)}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"
