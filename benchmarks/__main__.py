"""``python -m benchmarks``: what immediate updates cost, against plain JAX.

Run from the repository root. For each model, plain training (with and
without ``optax.apply_if_finite``) and immgrad (``current`` and
``updated``, with and without the atomic check) are compiled and run side
by side in one process; the figures are reported as ratios to plain
training measured in the same run, and the atomic methods' also to plain
training with ``apply_if_finite`` (see ``measure.py`` for how each is
taken, ``models.py`` for the models and methods). XLA's cost analysis
counts a loop's body once, so the FLOPs of a scanned model are those of
the same model unrolled. Writes ``benchmarks/results.json`` and
``benchmarks/depth.png`` (or ``--out``) and prints a Markdown table.

``--quick`` (under 5 minutes on 2 CPU cores) times 5 steps instead of 20,
uses smaller batches and sweeps a narrower MLP to depth 16; the default
follows the full settings below.

On an accelerator (or with ``--sizes accelerator``) the models are sized
for one: a GPT-small-shaped transformer (12 blocks, d 768, sequence 512)
unrolled and under ``hk.layer_stack``, wide MLPs, and a 24-block many-leaf
transformer; each method is compiled from shapes and run alone, its
parameters and state freed before the next's (``measure.measure_alone``),
and bytes accessed and counts of operations in the optimized HLO are
recorded too. ``--models`` keeps the models whose names contain one of the
given strings, ``--merge`` adds them to an existing results file,
``--profile`` also traces each method with ``jax.profiler`` and records
the device's step time and its time by kind of operation, and
``--hlo-dir`` writes each step's optimized HLO. See docs/costs.md.

``--immediate`` instead measures each immgrad method built by
``immgrad.immediate`` on the undecorated model against the same method
built by the model's adapter (``immgrad.immediate_layer``,
``immgrad.haiku.immediate``). At CPU sizes all in one process, interleaved:
writes ``benchmarks/results_immediate.json``; at accelerator sizes each
method alone as above (``--models``, ``--merge``, ``--profile`` apply):
writes ``results_immediate_accelerator.json``. Both print docs/costs.md's
table.

``python -m benchmarks.compile_tpu`` compiles the accelerator models for a
TPU v5e on a machine without one (FLOPs, bytes, memory, compile time).
"""

import argparse
import datetime
import json
import os
import platform
import sys

import jax

from benchmarks import measure
from benchmarks import models

HERE = os.path.dirname(os.path.abspath(__file__))


# The many-leaf model: 24 blocks of 16 parameter leaves each (390 leaves in
# all; 12 blocks with --quick), where per-parameter costs (compile time
# above all) show.
DEEP = dict(d_model=128, heads=4, mlp_size=512, seq=64)
SWEEP_METHODS = ("plain", "updated", "updated (atomic=False)", "naive")


def settings(quick: bool) -> dict:
  if quick:
    return dict(
      warmup=1,
      repeats=5,
      mlp=dict(depth=8, width=1024, batch=256),
      transformer=dict(batch=4),
      deep=dict(blocks=12, batch=2),
      depths=(2, 4, 8, 16),
      sweep=dict(width=256, batch=64),
    )
  return dict(
    warmup=2,
    repeats=20,
    mlp=dict(depth=8, width=1024, batch=256),
    transformer=dict(batch=16),
    deep=dict(blocks=24, batch=8),
    depths=(2, 4, 8, 16, 32),
    sweep=dict(width=1024, batch=256),
  )


def accelerator_models(methods=models.METHODS) -> list:
  """``(name, candidates, twin)`` for one accelerator chip (16 GB).

  Built lazily: each model's parameters are made only when it is measured.
  A twin is the loop-free model whose FLOPs a loop's figures take (or the
  name of one measured before it).
  """
  m = dict(methods=methods)
  gpt = dict(blocks=12, d_model=768, heads=12, mlp_size=3072, seq=512)
  deep = dict(blocks=24, d_model=256, heads=4, mlp_size=1024, seq=256)
  return [
    ("MLP 8x2048, batch 2048", lambda: models.mlp(8, 2048, 2048, **m), None),
    (
      "MLP 16x2048 under immgrad.scan, batch 1024",
      lambda: models.scanned_mlp(16, 2048, 1024, **m),
      lambda: models.mlp(16, 2048, 1024, **m),
    ),
    (
      "Transformer LM (12 blocks, d 768, seq 512, batch 16), unrolled",
      lambda: models.transformer(batch=16, **gpt, **m),
      None,
    ),
    (
      "Transformer LM (12 blocks, d 768, seq 512, batch 16), hk.layer_stack",
      lambda: models.transformer(batch=16, stacked=True, **gpt, **m),
      "Transformer LM (12 blocks, d 768, seq 512, batch 16), unrolled",
    ),
    (
      f"Transformer LM (24 blocks, d 256, seq 256, {16 * 24 + 6} leaves, "
      "batch 16)",
      lambda: models.transformer(batch=16, **deep, **m),
      None,
    ),
  ]


def main_accelerator(args, methods=models.METHODS) -> int:
  """The accelerator's models, each method measured alone.

  With ``models.IMMEDIATE_METHODS`` (``--immediate``): each immgrad method
  through ``immgrad.immediate`` and through the model's adapter.
  """
  immediate = methods == models.IMMEDIATE_METHODS
  default = "results_immediate_accelerator.json" if immediate else None
  path = os.path.join(
    args.out, args.name or default or "results_accelerator.json"
  )
  results = {
    "settings": {
      "warmup": 3,
      "repeats": 20,
      "optimizer": "adam(1e-3)",
      "sizes": "accelerator",
    },
    "machine": _machine(),
    "models": {},
  }
  if args.merge and os.path.exists(path):
    with open(path) as f:
      results["models"] = json.load(f)["models"]
  chosen = [
    (name, make, twin)
    for name, make, twin in accelerator_models(methods)
    if not args.models or any(m in name for m in args.models)
  ]
  known = {name for name, _, _ in chosen} | set(results["models"])
  for name, _, twin in chosen:  # Before an hour of measuring, not after.
    if isinstance(twin, str) and twin not in known:
      raise SystemExit(
        f"{name!r} takes its FLOPs from {twin!r}: select that model too "
        f"(--models), or --merge into a results file that holds it"
      )
  os.makedirs(args.out, exist_ok=True)
  for name, make, twin in chosen:
    print(f"measuring {name} ...", file=sys.stderr, flush=True)
    figures = {}
    for candidate in make():  # Saved after each: a later one may not fit.
      figures.update(
        measure.measure_alone(
          [candidate],
          warmup=3,
          repeats=20,
          hlo_dir=args.hlo_dir and os.path.join(args.hlo_dir, _slug(name)),
          profile=bool(args.profile) and any(p in name for p in args.profile),
        )
      )
      results["models"][name] = {"figures": figures, "partial": True}
      with open(path, "w") as f:
        json.dump(results, f, indent=1)
    entry = {"figures": figures}
    if twin is not None:  # A loop's FLOPs, from the same model unrolled.
      if isinstance(twin, str):
        unrolled = {
          m: f["flops"] for m, f in results["models"][twin]["figures"].items()
        }
      else:
        unrolled = measure.flops(twin())
      for method, flops in unrolled.items():
        figures[method]["flops_loop_body_once"] = figures[method]["flops"]
        figures[method]["flops"] = flops
      entry["flops_from"] = (
        twin if isinstance(twin, str) else "the same model unrolled"
      )
    keys = (
      "flops",
      "bytes_accessed",
      "peak_bytes",
      "median_step_seconds",
      "compile_seconds",
    )
    entry["ratios"] = measure.ratios(figures, keys=keys)
    if not immediate:
      entry["ratios_to_apply_if_finite"] = measure.ratios(
        figures, baseline="plain + apply_if_finite", keys=keys
      )
    results["models"][name] = entry
    with open(path, "w") as f:  # After each model: a later one may fail.
      json.dump(results, f, indent=1)
  print(immediate_table(results) if immediate else accelerator_table(results))
  return 0


def accelerator_table(results) -> str:
  """The accelerator run's table: step times (wall, and the device's own where
  traced), ratios to plain and to plain + apply_if_finite, HLO counts.
  """
  rows = [
    "| model | method | step ms (wall) | / plain | / apply_if_finite "
    "| device step ms | / plain | FLOPs | bytes accessed | peak memory "
    "| compile | conditionals | copies | fusions |",
    "| --- " * 14 + "|",
  ]
  for name, entry in results["models"].items():
    label = name
    base = entry["figures"]["plain"].get("device_step_seconds")
    for method, f in entry["figures"].items():
      r = entry["ratios"][method]
      peer = entry["ratios_to_apply_if_finite"][method]
      h = f["hlo"]
      device = f.get("device_step_seconds")
      device = (
        f"{device * 1e3:.2f} | {device / base:.3f}"
        if device and base
        else "- | -"
      )
      rows.append(
        f"| {label} | {method} | {f['median_step_seconds'] * 1e3:.2f} | "
        f"{r['median_step_seconds']:.3f} | "
        f"{peer['median_step_seconds']:.3f} | {device} | {r['flops']:.3f} | "
        f"{r['bytes_accessed']:.3f} | {r['peak_bytes']:.3f} | "
        f"{r['compile_seconds']:.2f} | {h['conditional']} | {h['copy']} | "
        f"{h['fusion']} |"
      )
      label = ""
  return "\n".join(rows)


def _slug(name: str) -> str:
  return "".join(c if c.isalnum() else "_" for c in name).strip("_")


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(
    prog="python -m benchmarks", description=__doc__.splitlines()[0]
  )
  parser.add_argument("--quick", action="store_true")
  parser.add_argument(
    "--out", default=HERE, help="folder for results.json and depth.png"
  )
  parser.add_argument(
    "--sizes",
    choices=("cpu", "accelerator"),
    help="model sizes (default: by JAX's default backend)",
  )
  parser.add_argument(
    "--name",
    help="results file name (accelerator sizes; "
    "default results_accelerator.json)",
  )
  parser.add_argument(
    "--models",
    nargs="*",
    help="only models whose names contain one of these",
  )
  parser.add_argument(
    "--merge",
    action="store_true",
    help="accelerator sizes: keep the results file's other models",
  )
  parser.add_argument(
    "--profile",
    nargs="*",
    help="accelerator sizes: trace the models whose names contain one of these",
  )
  parser.add_argument(
    "--hlo-dir",
    help="accelerator sizes: write each step's optimized HLO under this folder",
  )
  parser.add_argument(
    "--immediate",
    action="store_true",
    help="immgrad.immediate against the adapters",
  )
  args = parser.parse_args(argv)
  sizes = args.sizes or (
    "cpu" if jax.default_backend() == "cpu" else "accelerator"
  )
  if sizes == "accelerator":
    methods = models.IMMEDIATE_METHODS if args.immediate else models.METHODS
    return main_accelerator(args, methods)
  if args.immediate:
    return main_immediate(args)
  s = settings(args.quick)
  timing = dict(warmup=s["warmup"], repeats=s["repeats"])
  results = {
    "settings": {**s, "optimizer": "adam(1e-3)", "quick": args.quick},
    "machine": _machine(),
    "models": {},
    "depth_sweep": {},
  }

  def run(name, candidates, twin=None):
    print(f"measuring {name} ...", file=sys.stderr, flush=True)
    figures = measure.measure(candidates, **timing)
    entry = {"figures": figures}
    if twin is not None:  # A loop's FLOPs, from the same model unrolled.
      twin_name, twin_candidates = twin
      for method, flops in measure.flops(twin_candidates).items():
        figures[method]["flops"] = flops
      entry["flops_from"] = twin_name
    entry["ratios"] = measure.ratios(figures)
    entry["ratios_to_apply_if_finite"] = measure.ratios(
      figures, baseline="plain + apply_if_finite"
    )
    results["models"][name] = entry

  m, t, d = s["mlp"], s["transformer"], s["deep"]
  run(f"MLP {m['depth']}x{m['width']}, batch {m['batch']}", models.mlp(**m))
  run(
    f"Transformer LM (4 blocks, d 256, batch {t['batch']})",
    models.transformer(**t),
  )
  run(
    f"Transformer LM, blocks under hk.layer_stack (batch {t['batch']})",
    models.transformer(stacked=True, **t),
    twin=("the same, unrolled", models.transformer(**t)),
  )
  run(
    "MLP 16x1024 under immgrad.scan, batch 64",
    models.scanned_mlp(16, 1024, 64),
    twin=("MLP 16x1024, batch 64", models.mlp(16, 1024, 64)),
  )
  leaves = 16 * d["blocks"] + 6  # And embedding, positions, final norm, head.
  run(
    f"Transformer LM ({d['blocks']} blocks, d 128, {leaves} leaves, batch "
    f"{d['batch']})",
    models.transformer(**DEEP, **d),
  )
  for depth in s["depths"]:
    print(f"measuring depth {depth} ...", file=sys.stderr, flush=True)
    figures = measure.measure(
      models.mlp(depth, methods=SWEEP_METHODS, **s["sweep"]), **timing
    )
    results["depth_sweep"][depth] = {
      "figures": figures,
      "ratios": measure.ratios(figures),
    }

  os.makedirs(args.out, exist_ok=True)
  with open(os.path.join(args.out, "results.json"), "w") as f:
    json.dump(results, f, indent=1)
  _plot(results, os.path.join(args.out, "depth.png"))
  print(table(results))
  return 0


def main_immediate(args) -> int:
  """Each model's immgrad methods through immgrad.immediate and through its
  adapter, measured interleaved in one process.
  """
  s = settings(args.quick)
  m, t, d = s["mlp"], s["transformer"], s["deep"]
  methods = models.IMMEDIATE_METHODS
  # Compile time is this comparison's closest figure (the two fronts build
  # the same program): the median of several, interleaved.
  compiles = 3 if args.quick else 5
  results = {
    "settings": {
      **s,
      "compiles": compiles,
      "optimizer": "adam(1e-3)",
      "quick": args.quick,
    },
    "machine": _machine(),
    "models": {},
  }
  leaves = 16 * d["blocks"] + 6
  for name, make in (
    (
      f"MLP {m['depth']}x{m['width']}, batch {m['batch']}",
      lambda: models.mlp(**m, methods=methods),
    ),
    (
      "MLP 16x1024 under immgrad.scan / lax.scan, batch 64",
      lambda: models.scanned_mlp(16, 1024, 64, methods=methods),
    ),
    (
      f"Transformer LM (4 blocks, d 256, batch {t['batch']})",
      lambda: models.transformer(**t, methods=methods),
    ),
    (
      f"Transformer LM, blocks under hk.layer_stack (batch {t['batch']})",
      lambda: models.transformer(stacked=True, **t, methods=methods),
    ),
    (
      f"Transformer LM ({d['blocks']} blocks, d 128, {leaves} leaves, "
      f"batch {d['batch']})",
      lambda: models.transformer(**DEEP, **d, methods=methods),
    ),
  ):
    if args.models and not any(x in name for x in args.models):
      continue
    print(f"measuring {name} ...", file=sys.stderr, flush=True)
    figures = measure.measure(
      make(),
      warmup=s["warmup"],
      repeats=s["repeats"],
      compiles=compiles,
    )
    results["models"][name] = {
      "figures": figures,
      "ratios": measure.ratios(figures),
    }
  os.makedirs(args.out, exist_ok=True)
  with open(os.path.join(args.out, "results_immediate.json"), "w") as f:
    json.dump(results, f, indent=1)
  print(immediate_table(results))
  return 0


def immediate_table(results) -> str:
  """docs/costs.md's table: immgrad.immediate / the adapter, same run.

  Step times are the device clock's where both were traced (``--profile``).
  """
  rows = [
    "| model | method | FLOPs | peak memory | step time | compile time "
    "| adapter: step ms, compile s |",
    "| --- | --- | --- | --- | --- | --- | --- |",
  ]
  for name, entry in results["models"].items():
    label = name
    for method, auto in entry["figures"].items():
      if "(immediate" not in method:
        continue
      adapter = entry["figures"][
        method.replace("immediate, ", "").replace(" (immediate)", "")
      ]
      step = "median_step_seconds"
      if "device_step_seconds" in auto and "device_step_seconds" in adapter:
        step = "device_step_seconds"
      keys = ("flops", "peak_bytes", step, "compile_seconds")
      r = [auto[k] / adapter[k] for k in keys]
      rows.append(
        f"| {label} | {method} | {r[0]:.4f} | {r[1]:.4f} | {r[2]:.3f} | "
        f"{r[3]:.2f} | {adapter[step] * 1e3:.1f}, "
        f"{adapter['compile_seconds']:.1f} |"
      )
      label = ""
  return "\n".join(rows) + "\n\nRatios are immgrad.immediate / adapter."


def table(results) -> str:
  """The table in docs/costs.md: ratios to plain training (and, for atomic
  steps, to plain training with apply_if_finite), plain's absolute figures.
  """
  rows = [
    "| model | method | FLOPs | peak memory | step time | compile time "
    "| memory / apply_if_finite | step time / apply_if_finite |",
    "| --- | --- | --- | --- | --- | --- | --- | --- |",
  ]
  for name, entry in results["models"].items():
    plain = entry["figures"]["plain"]
    label = (
      f"{name} (plain: {plain['median_step_seconds'] * 1e3:.1f} ms, "
      f"{plain['peak_bytes'] / 2**20:.0f} MB)"
    )
    for method, r in entry["ratios"].items():
      if method == "plain":
        continue
      peer = entry["ratios_to_apply_if_finite"][method]
      atomic = method in ("current", "updated")  # The atomic shim's.
      vs_peer = (
        f"{peer['peak_bytes']:.3f} | {peer['median_step_seconds']:.3f}"
        if atomic
        else " | "
      )
      rows.append(
        f"| {label} | {method} | {r['flops']:.3f} | {r['peak_bytes']:.3f} "
        f"| {r['median_step_seconds']:.3f} | {r['compile_seconds']:.2f} | "
        f"{vs_peer} |"
      )
      label = ""
  rows += [
    "",
    "Depth sweep (MLP, ratio to plain at the same depth):",
    "",
    "| depth | method | FLOPs | step time | peak memory |",
    "| --- | --- | --- | --- | --- |",
  ]
  for depth, entry in results["depth_sweep"].items():
    for method, r in entry["ratios"].items():
      if method != "plain":
        rows.append(
          f"| {depth} | {method} | {r['flops']:.3f} | "
          f"{r['median_step_seconds']:.3f} | "
          f"{r['peak_bytes']:.3f} |"
        )
  return "\n".join(rows) + "\n\nRatios are immgrad / plain, same run."


def _plot(results, path):
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  depths = sorted(results["depth_sweep"], key=int)
  methods = [
    m for m in results["depth_sweep"][depths[0]]["ratios"] if m != "plain"
  ]
  fig, axes = plt.subplots(1, 2, figsize=(10, 4))
  for ax, key, label in (
    (axes[0], "median_step_seconds", "step time"),
    (axes[1], "flops", "FLOPs"),
  ):
    for method in methods:
      ax.plot(
        [int(d) for d in depths],
        [results["depth_sweep"][d]["ratios"][method][key] for d in depths],
        marker="o",
        label=method,
      )
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("MLP depth (layers)")
    ax.set_ylabel(f"{label} / plain training")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
  sweep = results["settings"]["sweep"]
  fig.suptitle(
    f"MLP width {sweep['width']}, batch {sweep['batch']}, adam; "
    f"{platform.processor() or platform.machine()}",
    fontsize=9,
  )
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def _machine() -> dict:
  import haiku
  import optax

  import immgrad

  return {
    "date": datetime.datetime.now().isoformat(timespec="seconds"),
    "platform": platform.platform(),
    "cpu_count": os.cpu_count(),
    "python": platform.python_version(),
    "devices": [str(d) for d in jax.devices()],
    "device_kind": jax.devices()[0].device_kind,
    "jax": jax.__version__,
    "optax": optax.__version__,
    "haiku": haiku.__version__,
    "immgrad": immgrad.__version__,
  }


if __name__ == "__main__":
  sys.exit(main())
