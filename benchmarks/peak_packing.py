"""The heap XLA packs against the bytes live at its peak, from XLA's dumps.

Compile the steps for the chip with XLA's dumps on, then read them::

  export XLA_FLAGS=--xla_dump_to=DIR PYTHONPATH=/tmp/libtpu
  python -m benchmarks.compile_tpu --models "24 blocks" --repeats 1 --methods current updated --out /tmp/r.json
  python benchmarks/peak_packing.py DIR

For each compiled ``jit_step`` module, in compilation order: the total
size of XLA's temporary heap (``memory-usage-report``: where the buffers
were placed) and the bytes live at the program's peak (``live-range``:
the values alive at the point where the most bytes are). docs/devlog.md,
"Peak memory: XLA's heap packing".
"""

import glob
import os
import re
import sys


def modules(folder: str) -> list:
  """``[(module, heap bytes, live bytes at the peak)]`` for each step."""
  rows = []
  pattern = os.path.join(folder, "*jit_step*after_optimizations-live-range.txt")
  for live in sorted(glob.glob(pattern)):
    stem = live[: -len("-live-range.txt")]
    with open(stem + "-memory-usage-report.txt") as f:
      heap = int(re.search(r"Total bytes: (\d+)", f.read()).group(1))
    with open(live) as f:
      peak = re.search(r"breakdown for peak usage: ([\d ]+) bytes", f.read())
    rows.append(
      (
        os.path.basename(stem).split(".")[0],
        heap,
        int(peak.group(1).replace(" ", "")),
      )
    )
  return rows


if __name__ == "__main__":
  for module, heap, live in modules(sys.argv[1]):
    print(
      f"{module}: heap {heap / 1e9:.4f} GB, live at peak {live / 1e9:.4f} GB"
    )
