"""PNG plots of bench.serve results: latency against request rate, throughput by concurrency.

`python -m bench.plots bench/plots/serve_results.json` redraws them from saved results.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # NOTE: files only, no display
    import matplotlib.pyplot as plt

    return plt


def latency_vs_rate(systems: dict[str, dict], path: Path) -> Path | None:
    plt = _pyplot()
    series = {name: s["rate"] for name, s in systems.items() if s.get("rate")}
    if not series:
        return None
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    panels = [("ttft_s", "TTFT (s)"), ("itl_s", "inter-token latency (s)"), ("e2e_s", "E2E (s)")]
    for ax, (key, label) in zip(axes, panels, strict=True):
        for name, points in series.items():
            xs = [p["request_rate"] for p in points]
            for q, style in (("p50", "-o"), ("p99", "--^")):
                ax.plot(xs, [_num(p[key][q]) for p in points], style, label=f"{name} {q}")
        ax.set_xlabel("request rate (req/s, Poisson)")
        ax.set_ylabel(label)
        ax.set_yscale("log")
        _plain_ticks(ax)
        ax.grid(True, alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle("Latency against request rate")
    return _save(plt, fig, path)


def throughput_vs_concurrency(systems: dict[str, dict], path: Path) -> Path | None:
    plt = _pyplot()
    series = {name: s["concurrency"] for name, s in systems.items() if s.get("concurrency")}
    if not series:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for name, points in series.items():
        xs = [p["concurrency"] for p in points]
        axes[0].plot(xs, [p["output_tokens_per_s"] for p in points], "-o", label=name)
        axes[1].plot(xs, [_num(p["ttft_s"]["p50"]) for p in points], "-o", label=f"{name} p50")
    axes[0].set_ylabel("output tokens/s")
    axes[1].set_ylabel("TTFT p50 (s)")
    for ax in axes:
        ax.set_xlabel("concurrent requests (closed loop)")
        ax.set_xscale("log", base=2)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("Throughput against concurrency")
    return _save(plt, fig, path)


def _plain_ticks(ax) -> None:
    from matplotlib.ticker import FuncFormatter

    # NOTE: plain numbers instead of 2x10^0; minor ticks labelled at 2, 3 and 5 only.
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.yaxis.set_minor_formatter(FuncFormatter(
        lambda v, _: f"{v:g}" if f"{v:.0e}"[0] in "235" else ""))


def _num(x: float | None) -> float:
    return float("nan") if x is None else x


def _save(plt, fig, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> None:
    path = Path((argv or sys.argv[1:])[0])
    systems = json.loads(path.read_text())["systems"]
    for made in (latency_vs_rate(systems, path.with_name("latency_vs_rate.png")),
                 throughput_vs_concurrency(systems,
                                           path.with_name("throughput_vs_concurrency.png"))):
        if made:
            print("wrote", made)


if __name__ == "__main__":
    main()
