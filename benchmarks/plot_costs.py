"""``python -m benchmarks.plot_costs``: docs/costs.md's figures.

Reads the committed results (``results.json``, the CPU; ``results_tpu_v5e.json``,
the chip) and draws, per model and method, the step time and the peak
memory as ratios to plain training in the same run: on the chip the
device's own step time where the run traced it (``--profile``), else the
wall clock. Writes ``docs/results/costs_cpu.png`` and
``docs/results/costs_tpu_v5e.png``.
"""

import json
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

HERE = os.path.dirname(os.path.abspath(__file__))
DOCS = os.path.join(os.path.dirname(HERE), "docs", "results")
METHODS = (
  "plain + apply_if_finite",
  "current",
  "updated",
  "current (atomic=False)",
  "updated (atomic=False)",
  "current (in place)",
  "updated (in place)",
)
COLOURS = (
  "#999999",
  "#1f77b4",
  "#d62728",
  "#9ecae1",
  "#fc9272",
  "#2ca02c",
  "#ff7f0e",
)
SHORT = {  # Model names as the figure's axis shows them.
  "MLP 8x1024, batch 256": "MLP 8x1024",
  "Transformer LM (4 blocks, d 256, batch 16)": "transformer\n4 blocks",
  "Transformer LM, blocks under hk.layer_stack (batch 16)": (
    "transformer\nhk.layer_stack"
  ),
  "MLP 16x1024 under immgrad.scan, batch 64": "MLP 16x1024\nimmgrad.scan",
  "Transformer LM (24 blocks, d 128, 390 leaves, batch 8)": (
    "transformer\n24 blocks"
  ),
  "MLP 8x2048, batch 2048": "MLP 8x2048",
  "MLP 16x2048 under immgrad.scan, batch 1024": "MLP 16x2048\nimmgrad.scan",
  "Transformer LM (12 blocks, d 768, seq 512, batch 16), unrolled": (
    "transformer\n12 blocks"
  ),
  "Transformer LM (12 blocks, d 768, seq 512, batch 16), hk.layer_stack": (
    "transformer\nhk.layer_stack"
  ),
  "Transformer LM (24 blocks, d 256, seq 256, 390 leaves, batch 16)": (
    "transformer\n24 blocks"
  ),
}


def step_ratio(entry: dict, method: str) -> float:
  """Step time over plain's: the device clock where traced, else the wall."""
  figures = entry["figures"]
  device = figures[method].get("device_step_seconds")
  plain = figures["plain"].get("device_step_seconds")
  if device and plain:
    return device / plain
  return entry["ratios"][method]["median_step_seconds"]


def plot(results: dict, title: str, path: str) -> None:
  """Two panels of bars from 1.0 (plain): step time and peak memory."""
  names = list(results["models"])
  figures = results["models"][names[0]]["figures"]
  methods = [m for m in METHODS if m in figures]  # What the file measured.
  fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
  width = 0.8 / len(methods)
  panels = (
    ("step time / plain", step_ratio),
    ("peak memory / plain", lambda e, m: e["ratios"][m]["peak_bytes"]),
  )
  for ax, (label, value) in zip(axes, panels):
    ys = []
    for i, method in enumerate(methods):
      colour = COLOURS[METHODS.index(method)]
      xs = [n + (i - (len(methods) - 1) / 2) * width for n in range(len(names))]
      y = [value(results["models"][name], method) for name in names]
      ax.bar(
        xs, [v - 1 for v in y], width, bottom=1, color=colour, label=method
      )
      ys += y
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(names)))
    ax.set_xticklabels([SHORT.get(n, n) for n in names], fontsize=8)
    ax.set_ylabel(label)
    ax.set_ylim(min(ys) - 0.05, max(ys) + 0.05)
    ax.grid(axis="y", alpha=0.3)
  handles, labels = axes[0].get_legend_handles_labels()
  fig.legend(
    handles,
    labels,
    loc="upper center",
    ncol=len(methods),
    fontsize=8,
    bbox_to_anchor=(0.5, 0.93),
    frameon=False,
  )
  fig.suptitle(title, fontsize=10)
  fig.tight_layout(rect=(0, 0, 1, 0.88))
  fig.savefig(path, dpi=100)
  plt.close(fig)


def main() -> int:
  for name, title, out in (
    (
      "results.json",
      "CPU (2 cores, x86_64): ratios to plain training in the same run",
      "costs_cpu.png",
    ),
    (
      "results_tpu_v5e.json",
      "TPU v5e (one chip, device clock): ratios to plain training "
      "in the same run",
      "costs_tpu_v5e.png",
    ),
  ):
    with open(os.path.join(HERE, name)) as f:
      plot(json.load(f), title, os.path.join(DOCS, out))
  return 0


if __name__ == "__main__":
  sys.exit(main())
