"""Pictures of a simulation result (matplotlib, Agg backend; nothing opens a window).

- spike: capacity against demand over time for each cold-start time, shortage shaded; the
  buffer-versus-cold-start frontier beside the two start-up times AOT compilation was
  published with (5.6 min before, 26 s after).
- cost: GPU-hours per day and cost per 1,000 requests per policy as bars beside the figures the
  snapshot-restore design published, SLA compliance written on each bar; billed replicas over time.
- trace: billed and warm replicas over time per policy.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402


def _spike_axes(result: dict, ax_time, ax_frontier) -> None:
    demand_t = np.asarray(result["demand"]["t_s"]) / 60.0
    demand = np.asarray(result["demand"]["calls"])
    colours = plt.cm.viridis(np.linspace(0, 0.9, len(result["series"])))
    ax_time.plot(demand_t, demand, color="black", lw=1.6, label="demand (calls in flight)")
    for colour, s in zip(colours, result["series"], strict=True):
        t = np.asarray(s["t_s"]) / 60.0
        cap = np.interp(demand_t, t, np.asarray(s["capacity"], dtype=float))
        ax_time.plot(demand_t, cap, color=colour, lw=1.0,
                     label=f"capacity, cold start {s['cold_start_s']:.0f} s")
        ax_time.fill_between(demand_t, cap, demand, where=demand > cap, color=colour, alpha=0.35)
    settled = demand_t >= result.get("warmup_s", 0.0) / 60.0
    if settled.any():
        ax_time.set_xlim(demand_t[settled][0], demand_t[-1])
        ax_time.set_ylim(0.85 * demand[settled].min(), None)
    ax_time.set_xlabel("minutes")
    ax_time.set_ylabel("concurrent calls")
    ax_time.set_title("Spike at a 10% buffer: capacity vs demand (shortage shaded)")
    ax_time.legend(fontsize=7, loc="upper left")

    sweep = result["sweep"]
    cs = [r["cold_start_s"] for r in sweep]
    mb = [np.nan if r["min_buffer_pct_zero_drops"] is None else r["min_buffer_pct_zero_drops"]
          for r in sweep]
    ax_frontier.plot(cs, mb, "o-", label="rewarm sim: smallest buffer, zero drops")
    ax_frontier.plot([26], [3], "v", color="tab:red", label="published AOT figure: 26 s needs < 3%")
    ax_frontier.plot([336], [18], "s", color="tab:red", label="published AOT figure: 5.6 min ~18%")
    ax_frontier.axhline(10, ls=":", color="grey", lw=0.8)
    for r in sweep:
        ax_frontier.annotate(f"{r['dropped_at_10pct']} dropped\n@10%", (r["cold_start_s"],
                             0 if r["min_buffer_pct_zero_drops"] is None
                             else r["min_buffer_pct_zero_drops"]),
                             fontsize=6, textcoords="offset points", xytext=(4, -14))
    ax_frontier.set_xlabel("cold start (s)")
    ax_frontier.set_ylabel("spare capacity needed (%)")
    ax_frontier.set_title("Buffer vs cold-start frontier")
    ax_frontier.legend(fontsize=7)


def _cost_axes(result: dict, ax_bars, ax_time) -> None:
    names = [p["name"] for p in result["policies"]]
    ours = [p["gpu_hours_per_day"] for p in result["policies"]]
    doc = [result["doc"].get(n, {}).get("gpu_hours_per_day", np.nan) for n in names]
    x = np.arange(len(names))
    ax_bars.bar(x - 0.2, doc, 0.4, color="lightgrey", label="snapshot-restore design (published)")
    bars = ax_bars.bar(x + 0.2, ours, 0.4, color="tab:blue", label="rewarm sim")
    for b, p in zip(bars, result["policies"], strict=True):
        ax_bars.annotate(f"SLA {100 * p['sla_compliance']:.2f}%\n"
                         f"${p['cost_per_1000_requests']:.3f}/1k",
                         (b.get_x() + b.get_width() / 2, b.get_height()), ha="center",
                         fontsize=6, textcoords="offset points", xytext=(0, 2))
    always = next((p["gpu_hours_per_day"] for p in result["policies"]
                   if p["name"] == "always_on"), None)
    if always:
        ax_bars.axhline(0.2 * always, ls=":", color="tab:red", lw=0.8,
                        label="20% of always-on (goal)")
    ax_bars.set_xticks(x, names, rotation=15, fontsize=7)
    ax_bars.set_ylabel("GPU-hours per day")
    ax_bars.set_title("Cost table: GPU-hours/day, SLA, $ per 1,000 requests")
    ax_bars.legend(fontsize=7)
    for p in result["policies"]:
        s = p["series"]
        ax_time.plot(np.asarray(s["t_s"]) / 3600.0, s["billed"], lw=0.8, label=p["name"])
    ax_time.set_xlabel("hours")
    ax_time.set_ylabel("billed replicas (GPUs)")
    ax_time.set_title("GPUs held over time")
    ax_time.legend(fontsize=7)


def plot(result: dict, path: Path, dpi: int = 110) -> Path:
    """Draw ``result`` (a ``spike``, ``cost`` or ``trace`` result dict) into PNG ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, axes = plt.subplots(1, 2, figsize=(14, 5.5),
                             gridspec_kw={"width_ratios": [1.6, 1]}
                             if result["scenario"] == "spike" else None)
    if result["scenario"] == "spike":
        _spike_axes(result, axes[0], axes[1])
    else:
        _cost_axes(result, axes[0], axes[1])
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return path
