"""Bytes each part of a TPU program moves by asynchronous copies.

XLA's TPU compiler places buffers in HBM or in the core's vector memory
(VMEM, ``S(1)`` in a layout) and moves them between the two with
``copy-start``/``copy-done`` pairs, which the chip's traces count as
``copy-done`` time. Reads optimized HLO that ``python -m
benchmarks.compile_tpu --hlo-dir DIR`` wrote, and prints, for each file,
the copies and their bytes in the entry computation and in each ``while``
body (one iteration)::

  python benchmarks/async_copies.py DIR/MODEL/*.hlo.txt

docs/devlog.md, "`hk.layer_stack`: optimizer state through loops, and copies".
"""

import collections
import re
import sys

BYTES = {"f32": 4, "bf16": 2, "s32": 4, "u32": 4, "pred": 1}
COPY = re.compile(r"= \((\w+)\[([\d,]*)\]\{[^}]*\}, .*\) copy-start\(")
HEADER = re.compile(r"^(ENTRY )?(%\S+) \(")


def copies(text: str) -> dict:
  """``{computation: (count, bytes)}`` of the copy-starts in ``text``."""
  bodies = set(re.findall(r"body=(%[^ ,]+)", text))
  found = collections.defaultdict(lambda: [0, 0])
  part = None
  for line in text.splitlines():
    header = HEADER.match(line)
    if header:
      name = header.group(2)
      part = "entry" if header.group(1) else name if name in bodies else None
    copy = COPY.search(line)
    if copy and part:
      dims = [int(d) for d in copy.group(2).split(",") if d]
      size = BYTES[copy.group(1)]
      for d in dims:
        size *= d
      found[part][0] += 1
      found[part][1] += size
  return {k: tuple(v) for k, v in found.items()}


if __name__ == "__main__":
  for path in sys.argv[1:]:
    print(path.rsplit("/", 1)[-1])
    with open(path) as f:
      for part, (n, size) in copies(f.read()).items():
        print(f"  {part[:40]}: {n} copies, {size / 1e6:.1f} MB")
