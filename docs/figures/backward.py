"""Draws backward.png: the backward pass of a 3-layer model, each layer stepped inside it.

``python docs/figures/backward.py`` writes it next to this file (matplotlib:
the ``experiments`` or ``test`` extra).
"""

import pathlib

from matplotlib.figure import Figure
from matplotlib.patches import FancyBboxPatch

OUT = pathlib.Path(__file__).with_suffix(".png")
FORWARD, BACKWARD, COMMIT = "#dbe9f6", "#fdebd3", "#e2f0d9"
COLUMNS = (1.85, 5.05, 8.25)  # the centre of each layer
STEPS = (
  "1  dY arrives",
  "2  dW from the residuals",
  "3  pmean(dW) over replicas",
  "4  optax step, its own state:",
  "     W \u2192 W_new",
  "5  dX at W (current),",
  "     at W_new (updated),",
  "     or at W + a (W_new \u2212 W)",
)


def box(ax, x, y, w, h, text, color, **kw):
  ax.add_patch(
    FancyBboxPatch(
      (x, y),
      w,
      h,
      boxstyle="round,pad=0.02,rounding_size=0.08",
      facecolor=color,
      edgecolor="#444444",
      linewidth=1.0,
    )
  )
  ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", **kw)


def arrow(ax, start, end, label="", color="#222222", style="-|>", **kw):
  ax.annotate(
    "",
    xy=end,
    xytext=start,
    arrowprops=dict(arrowstyle=style, color=color, lw=1.6, **kw),
  )
  if label:
    ax.text(
      (start[0] + end[0]) / 2,
      (start[1] + end[1]) / 2 + 0.12,
      label,
      ha="center",
      va="bottom",
      fontsize=10,
      color=color,
    )


def main():
  fig = Figure(figsize=(10, 5.8), dpi=100)
  ax = fig.subplots()
  ax.set(xlim=(0, 10), ylim=(0.15, 6.0))
  ax.axis("off")
  ax.text(
    5,
    5.7,
    "One training step: each layer is stepped inside the backward pass",
    ha="center",
    fontsize=13,
    weight="bold",
  )

  # Forward, left to right.
  ax.text(
    0.05, 5.45, "forward \u2192", fontsize=11, style="italic", va="center"
  )
  box(ax, 0.05, 4.75, 0.5, 0.45, "x", FORWARD, fontsize=11)
  for i, cx in enumerate(COLUMNS, 1):
    box(
      ax, cx - 0.7, 4.7, 1.4, 0.55, f"layer {i}  (W{i})", FORWARD, fontsize=11
    )
  box(ax, 9.2, 4.75, 0.7, 0.45, "loss", FORWARD, fontsize=11)
  ends = [0.55] + [cx + 0.7 for cx in COLUMNS]
  starts = [cx - 0.7 for cx in COLUMNS] + [9.2]
  for a, b in zip(ends, starts, strict=True):
    arrow(ax, (a, 4.975), (b, 4.975))

  # Backward, right to left: one box of five steps per layer.
  ax.text(
    0.05, 4.4, "\u2190 backward", fontsize=11, style="italic", va="center"
  )
  top, bottom, width = 4.15, 2.1, 2.8
  for cx in COLUMNS:
    ax.add_patch(
      FancyBboxPatch(
        (cx - width / 2, bottom),
        width,
        top - bottom,
        boxstyle="round,pad=0.02,rounding_size=0.08",
        facecolor=BACKWARD,
        edgecolor="#444444",
        linewidth=1.0,
      )
    )
    ax.text(
      cx - width / 2 + 0.1,
      top - 0.12,
      "\n".join(STEPS),
      ha="left",
      va="top",
      fontsize=10,
      linespacing=1.5,
    )
    ax.plot([cx, cx], [4.7, top + 0.03], ls=":", color="#777777", lw=1.2)
  ax.text(COLUMNS[0] + 0.07, 4.42, "residuals", fontsize=9, color="#555555")
  # dY from the loss into layer 3, then each dX on to the previous layer.
  arrow(ax, (9.55, 4.73), (9.55, top + 0.04))
  ax.text(9.62, 4.4, "dY", fontsize=10)
  y = 2.72
  for right, left in zip(COLUMNS[1:], COLUMNS[:-1], strict=True):
    arrow(
      ax,
      (right - width / 2 - 0.02, y),
      (left + width / 2 + 0.02, y),
      label="dX",
    )
  arrow(ax, (COLUMNS[0] - width / 2 - 0.02, y), (0.0, y), label="dX")

  # dW leaves each layer through W's cotangent slot; the shim commits.
  for cx in COLUMNS:
    arrow(ax, (cx, bottom - 0.02), (cx, 0.98), color="#2d6a2d")
    ax.text(cx + 0.08, 1.5, "dW (cotangent slot)", fontsize=10, color="#2d6a2d")
  box(
    ax,
    0.45,
    0.22,
    9.2,
    0.74,
    "then tx.update (the shim) commits every layer: the same optax step\n"
    "on the same dW, state and W \u2192 W_new (atomic: all or nothing)",
    COMMIT,
    fontsize=10.5,
    linespacing=1.5,
  )
  fig.subplots_adjust(left=0.01, right=0.99, bottom=0, top=1)
  fig.savefig(OUT, metadata={"Software": None})


if __name__ == "__main__":
  main()
