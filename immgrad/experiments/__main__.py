"""``python -m immgrad.experiments``: does updated backprop train faster?

Trains one task three ways (plain, immgrad ``current``, immgrad
``updated``) from the same initialisation and data order, data parallel
over simulated CPU devices, then prints a results table and writes
``results.json`` and ``loss_curves.png`` to ``--out``. With
``--mode-sweep`` the immgrad methods are one per fraction ``a`` of the
update that dX sees (``mode=a``), compared with ``a=0``; with
``--measure-dx`` each immgrad layer's dX change is recorded per step and
plotted (``dx_change.png``). See ``python -m immgrad.experiments --help``
and the README's "Does it train faster?" and "Between the modes".
"""

import argparse
import datetime
import os
import sys

import jax

from immgrad.experiments import report
from immgrad.experiments import tasks as tasks_lib
from immgrad.experiments import train as train_lib

# name -> (steps, batch size), default and --quick.
SIZES = {"digits": ((600, 128), (150, 128)), "chars": ((500, 32), (120, 32)),
         "deep_mlp": ((2000, 128), (500, 128)),
         "deep_transformer": ((2000, 8), (500, 8))}
DEFAULT_MODES = [0.0, 0.25, 0.5, 1.0, -0.5]
DEFAULT_SEEDS = {False: [0, 1, 2], True: [0]}  # By --quick.


def parse(argv):
  p = argparse.ArgumentParser(
      prog="python -m immgrad.experiments",
      description="Train a task with plain backprop and with immgrad's "
                  "immediate updates (mode current and updated), and compare "
                  "them in steps and in wall time.")
  p.add_argument("--task", choices=sorted(tasks_lib.TASKS), default="digits")
  p.add_argument("--optimizer", default="adam",
                 choices=["sgd", "momentum", "adam", "adamw"])
  p.add_argument("--lr", type=float, default=None,
                 help="learning rate (default: the task's for the optimizer)")
  p.add_argument("--steps", type=int, default=None)
  p.add_argument("--batch-size", type=int, default=None,
                 help="global batch size, split over the devices")
  p.add_argument("--devices", type=int, default=4,
                 help="simulated CPU devices to train data parallel on")
  p.add_argument("--seeds", type=int, nargs="+", default=None,
                 help="seeds to repeat the run with; mean and spread are "
                      "reported (default: 0 1 2, or 0 with --quick)")
  p.add_argument("--lr-sweep", action="store_true",
                 help="also train at the learning rate times 2**k, k=-3..3 "
                      "(or --lrs), and report each method's best and lowest "
                      "diverging learning rate")
  p.add_argument("--lrs", type=float, nargs="+", default=None)
  p.add_argument("--mode-sweep", action="store_true",
                 help="instead of current and updated, train immgrad at "
                      "mode=a for each a of --modes (dX at W + a*(W_new - "
                      "W); a=0 is current, a=1 updated), report each a's "
                      "final loss over seeds, the best a, and whether any "
                      "nonzero a beats a=0 beyond the seed spread; with "
                      "--lr-sweep, every lr x a")
  p.add_argument("--modes", type=float, nargs="+", default=None,
                 help="the a of --mode-sweep (implies it; default 0 0.25 "
                      "0.5 1 -0.5; 0 is always added: it is the reference)")
  p.add_argument("--measure-dx", action="store_true",
                 help="record, per immediate layer and step, |dX_updated - "
                      "dX_current| / |dX_current| for every immgrad method "
                      "(measure_dx=True; one more input-gradient product per "
                      "layer, in the timed steps); writes dx_change.png")
  p.add_argument("--target", type=float, default=None,
                 help="target loss for steps/seconds to target (default: "
                      "the highest final smoothed training loss of the "
                      "methods, which all of them reach)")
  p.add_argument("--eval-every", type=int, default=None)
  p.add_argument("--text", default=None,
                 help="chars task: train on this text file instead of the "
                      "Python standard library's source")
  p.add_argument("--quick", action="store_true",
                 help="a short run (about a quarter of the steps)")
  p.add_argument("--out", default=None,
                 help="output folder (default: a new folder named after the "
                      "task and the time)")
  p.add_argument("--no-progress", action="store_true")
  return p.parse_args(argv)


def main(argv=None):
  args = parse(argv)
  try:
    jax.config.update("jax_num_cpu_devices", args.devices)
  except RuntimeError as e:  # The backend started before us.
    if jax.device_count() < args.devices:
      raise SystemExit(f"immgrad.experiments: cannot make {args.devices} "
                       f"devices: {e}") from e
  if jax.device_count() < args.devices:
    raise SystemExit(f"immgrad.experiments: --devices {args.devices}, but "
                     f"only {jax.device_count()} are available.")
  task = (tasks_lib.TASKS[args.task](args.text)
          if args.task in tasks_lib.TEXT_TASKS else tasks_lib.TASKS[args.task]())
  modes = None
  if args.mode_sweep or args.modes:
    modes = list(dict.fromkeys([0.0] + [float(a) for a in
                                        (args.modes or DEFAULT_MODES)]))
  methods = train_lib.methods_of(modes)
  steps, batch_size = SIZES[args.task][1 if args.quick else 0]
  steps = args.steps or steps
  batch_size = args.batch_size or batch_size
  lr = args.lr or task.default_lr[args.optimizer]
  args.seeds = args.seeds or DEFAULT_SEEDS[args.quick]
  eval_every = args.eval_every or max(1, steps // 10)
  lrs = [lr]
  if args.lr_sweep:
    lrs = sorted(set(args.lrs or [lr * 2.0 ** k for k in range(-3, 4)]) |
                 {lr})
  out = args.out or datetime.datetime.now().strftime(
      f"immgrad-experiment-{task.name}-%Y%m%d-%H%M%S")
  os.makedirs(out, exist_ok=True)
  settings = dict(task=task.name, optimizer=args.optimizer, lr=lr,
                  steps=steps, batch_size=batch_size, devices=args.devices,
                  seeds=args.seeds, lrs=lrs, eval_every=eval_every,
                  target=args.target, quick=args.quick, modes=modes,
                  methods=list(methods), measure_dx=args.measure_dx)
  print(f"task: {task.description}", file=sys.stderr)
  print(f"settings: {settings}", file=sys.stderr)

  records, sanity, aggregates, summaries = [], [], {}, {}
  for run_lr in lrs:
    per_method = {m: [] for m in methods}
    for seed in args.seeds:
      bar = _progress(args, total=steps,
                      desc=f"{task.name} lr={run_lr:g} seed={seed}")
      runs = train_lib.train(task, optimizer_name=args.optimizer, lr=run_lr,
                             steps=steps, batch_size=batch_size, seed=seed,
                             eval_every=eval_every, progress=bar,
                             methods=methods, measure_dx=args.measure_dx)
      if bar is not None:
        bar.close()
      target = args.target or report.default_target(runs, steps)
      for method, run in runs.items():
        summary = report.summarise(run, runs["plain"], steps, target)
        summary["target"] = target
        per_method[method].append(summary)
        record = dict(lr=run_lr, seed=seed, method=method,
                      losses=run.losses, seconds=run.seconds,
                      evals=run.evals, summary=summary)
        if run.dx_change is not None:
          record["dx_change"] = {k: [float(f"{v:.4g}") for v in vs]
                                 for k, vs in run.dx_change.items()}
          summary["dx"] = report.dx_summary(run.dx_change, run.diverged_at)
        records.append(record)
      sanity.append(dict(lr=run_lr, seed=seed, **report.sanity(runs)))
    aggregates[run_lr] = {m: report.aggregate(
        [{k: v for k, v in s.items() if k != "dx"} for s in ss])
                          for m, ss in per_method.items()}
    summaries[run_lr] = per_method

  main_records = [r for r in records if r["lr"] == lr]
  text = [f"## {task.description}",
          f"{args.optimizer}, lr {lr:g}, {steps} steps, batch {batch_size} "
          f"over {args.devices} devices, seeds {args.seeds}", "",
          report.table(aggregates[lr], task.loss_unit), ""]
  checks = [s for s in sanity if s["lr"] == lr]
  passed = all(s["passed"] for s in checks)
  worst = max(s["max_relative_loss_difference_first_steps"] for s in checks)
  whole = max(s["max_relative_loss_difference_whole_run"] for s in checks)
  reference = report.reference_method(methods)
  text.append(
      f"Sanity check ({reference} reproduces plain): "
      f"{'PASSED' if passed else 'FAILED'}: largest relative loss "
      f"difference {worst:.2g} over the first {report.SANITY_STEPS} steps "
      f"(must be <= {report.SANITY_RTOL:g}); {whole:.2g} over the whole run.")
  sweep = None
  if args.lr_sweep:
    sweep = _sweep(aggregates, methods)
    text += ["", _sweep_table(sweep, aggregates, methods)]
  mode_sweep = None
  if modes is not None:
    mode_sweep, mode_text = _mode_sweep(summaries, lr, sweep, methods, task,
                                        args.optimizer)
    text += ["", mode_text]
  dx_rows = None
  if args.measure_dx:
    dx_rows = _dx_rows(summaries, methods)
    text += ["", report.dx_table(dx_rows)]
  text += ["", report.__doc__.split("\n\n", 1)[1].strip()]
  print("\n".join(text))

  report.write_json(os.path.join(out, "results.json"), dict(
      settings=settings, task=task.description, loss_unit=task.loss_unit,
      machine=report.machine(), aggregates={str(k): v for k, v in
                                            aggregates.items()},
      sanity=sanity, lr_sweep=sweep, mode_sweep=mode_sweep,
      dx_change=dx_rows, runs=records))
  report.plot(os.path.join(out, "loss_curves.png"), main_records, steps,
              task.loss_unit, f"{task.name}: {args.optimizer} lr {lr:g}, "
              f"seeds {args.seeds}")
  written = ["results.json", "loss_curves.png"]
  if args.measure_dx:
    report.plot_dx(os.path.join(out, "dx_change.png"), records,
                   f"{task.name}: {args.optimizer}")
    written.append("dx_change.png")
  print(f"\nwrote {', '.join(f'{out}/{w}' for w in written)}")
  return 0 if passed else 1


def _mode_sweep(summaries, lr, sweep, methods, task, optimizer):
  """The mode sweep's tables: at the main lr, at each lr, and each tuned."""
  out, texts = {}, []
  head = f"{task.name}, {optimizer}"
  lrs = sorted(summaries) if sweep else [lr]
  for lr_value in lrs:
    t, result = report.mode_table(
        summaries[lr_value], task.loss_unit,
        f"Mode sweep, {head}, lr {lr_value:g}: final losses over seeds, "
        "and the paired difference from a=0 (positive: better than a=0).")
    out[str(lr_value)] = result
    texts.append(t)
  if sweep:  # Each method at its own best learning rate.
    tuned = {}
    for m in methods:
      best = sweep[m]["best_lr"]
      tuned[m] = (summaries[best][m] if best is not None else
                  summaries[lrs[0]][m])
    t, result = report.mode_table(
        tuned, task.loss_unit,
        f"Mode sweep, {head}, each method at its own best lr ("
        + ", ".join(f"{m} {sweep[m]['best_lr']:g}" if sweep[m]["best_lr"]
                    else f"{m} -" for m in methods) + ").")
    out["tuned"] = result
    texts.append(t)
  return out, "\n\n".join(texts)


def _dx_rows(summaries, methods):
  rows = []
  for lr_value in sorted(summaries):
    for m in methods:
      ss = summaries[lr_value][m]
      if not any("dx" in s for s in ss):
        continue
      rows.append({"lr": lr_value, "method": m,
                   "diverged_at": [s["diverged_at"] for s in ss
                                   if s["diverged_at"] is not None],
                   "summaries": [s.get("dx") for s in ss]})
  return rows


def _progress(args, total, desc):
  if args.no_progress:
    return None
  from tqdm import tqdm  # pylint: disable=g-import-not-at-top
  return tqdm(total=total, desc=desc, leave=False, dynamic_ncols=True)


def _sweep(aggregates, methods):
  """Per method: the best learning rate, and the lowest that diverges."""
  out = {}
  for method in methods:
    finals, diverging = {}, []
    for lr_value, by_method in aggregates.items():
      agg = by_method[method]
      if agg["diverged_runs"]:
        diverging.append(lr_value)
      elif agg["final_smoothed_train_loss"] is not None:
        finals[lr_value] = agg["final_smoothed_train_loss"]["mean"]
    out[method] = {
        "best_lr": min(finals, key=finals.get) if finals else None,
        "best_final_smoothed_train_loss": min(finals.values())
                                          if finals else None,
        "lowest_diverging_lr": min(diverging) if diverging else None}
  return out


def _sweep_table(sweep, aggregates, methods):
  methods = list(methods)
  rows = ["Learning-rate sweep: final smoothed training loss (mean over "
          "seeds), or the step it diverged at.", "",
          "| lr | " + " | ".join(methods) + " |",
          "|" + " --- |" * (len(methods) + 1)]
  for lr_value in sorted(aggregates):
    cells = []
    for m in methods:
      agg = aggregates[lr_value][m]
      if agg["diverged_runs"]:
        cells.append("diverged at step " +
                     ", ".join(str(s) for s in agg["diverged_at"]))
      else:
        cells.append(report._cell(agg["final_smoothed_train_loss"]))  # pylint: disable=protected-access
    rows.append(f"| {lr_value:g} | " + " | ".join(cells) + " |")
  rows.append("")
  for m in methods:
    s = sweep[m]
    best = "-" if s["best_lr"] is None else f"{s['best_lr']:g}"
    div = ("none of those tried" if s["lowest_diverging_lr"] is None
           else f"{s['lowest_diverging_lr']:g}")
    rows.append(f"- {m}: best lr {best}, lowest diverging lr {div}")
  return "\n".join(rows)


if __name__ == "__main__":
  sys.exit(main())
