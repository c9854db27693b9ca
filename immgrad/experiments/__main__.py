"""``python -m immgrad.experiments``: does updated backprop train faster?

Trains one task plain, ``current`` and ``updated`` (or a sweep of
``mode=a``) from the same initialisation and data order, data parallel;
prints each method against plain (paired by seed, 95% t intervals) and
writes ``results.json`` and figures to ``--out`` (``--help``;
docs/faster.md, docs/between-modes.md, docs/results/lm.md).
"""

import argparse
import datetime
import os
import sys

import jax

from immgrad.experiments import report
from immgrad.experiments import stats
from immgrad.experiments import tasks as tasks_lib
from immgrad.experiments import train as train_lib

# name -> (steps, batch size), default and --quick.
SIZES = {
  "digits": ((600, 128), (150, 128)),
  "chars": ((500, 32), (120, 32)),
  "deep_mlp": ((2000, 128), (500, 128)),
  "deep_transformer": ((2000, 8), (500, 8)),
  # lm: 16,384 bytes a step for small and base (32 x 512).
  "lm_tiny": ((300, 16), (40, 16)),
  "lm_small": ((3000, 32), (750, 32)),
  "lm_base": ((2000, 32), (500, 32)),
}
CPU_DEVICES = 4  # Simulated, where the default backend is the CPU.
DEFAULT_MODES = [0.0, 0.25, 0.5, 1.0, -0.5]
DEFAULT_SEEDS = {False: [0, 1, 2], True: [0]}  # By --quick.


def parse(argv):
  p = argparse.ArgumentParser(
    prog="python -m immgrad.experiments",
    description="Train a task with plain backprop and with immgrad's "
    "immediate updates (mode current and updated), and compare "
    "them in steps and in wall time.",
  )
  p.add_argument("--task", choices=sorted(tasks_lib.TASKS), default="digits")
  p.add_argument(
    "--size",
    choices=["tiny", "small", "base"],
    default=None,
    help="lm task: the model (default tiny: CPU, seconds; "
    "small ~10.9M and base ~85M parameters, context 512)",
  )
  p.add_argument(
    "--blocks",
    type=int,
    default=None,
    help="lm task: this many blocks instead of the size's, all else as "
    "the size (depth alone varied)",
  )
  p.add_argument(
    "--width",
    type=int,
    default=None,
    help="lm task: this d_model instead of the size's, a multiple of its "
    "heads, all else as the size (width alone varied)",
  )
  p.add_argument(
    "--remat",
    action="store_true",
    help="lm task: recompute each block's activations in the "
    "backward pass (hk.remat): less memory, ~23%% more "
    "FLOPs, the same for every method",
  )
  p.add_argument(
    "--optimizer",
    default=None,
    choices=["sgd", "momentum", "adam", "adamw"],
    help="default: adamw for lm (warm-up and cosine decay, "
    "weight decay on matrices), else adam",
  )
  p.add_argument(
    "--lr",
    type=float,
    default=None,
    help="learning rate (default: the task's for the optimizer)",
  )
  p.add_argument("--steps", type=int, default=None)
  p.add_argument(
    "--batch-size",
    type=int,
    default=None,
    help="global batch size, split over the devices",
  )
  p.add_argument(
    "--devices",
    type=int,
    default=None,
    help="devices to train data parallel on (default: all "
    "local devices of the default backend; 4 simulated "
    "ones where it is the CPU)",
  )
  p.add_argument(
    "--seeds",
    type=int,
    nargs="+",
    default=None,
    help="seeds to repeat the run with; mean and spread are "
    "reported (default: 0 1 2, or 0 with --quick)",
  )
  p.add_argument(
    "--lr-sweep",
    action="store_true",
    help="also train at the learning rate times 2**k, k=-3..3 "
    "(or --lrs), and report each method's best and lowest "
    "diverging learning rate",
  )
  p.add_argument("--lrs", type=float, nargs="+", default=None)
  p.add_argument(
    "--mode-sweep",
    action="store_true",
    help="instead of current and updated, train immgrad at "
    "mode=a for each a of --modes (dX at W + a*(W_new - "
    "W); a=0 is current, a=1 updated), report each a's "
    "final loss over seeds, the best a, and whether any "
    "nonzero a beats a=0 (paired 95%% t interval); with "
    "--lr-sweep, every lr x a",
  )
  p.add_argument(
    "--modes",
    type=float,
    nargs="+",
    default=None,
    help="the a of --mode-sweep (implies it; default 0 0.25 "
    "0.5 1 -0.5; 0 is always added: it is the reference)",
  )
  p.add_argument(
    "--methods",
    nargs="+",
    default=None,
    help="train only these of the run's methods (plain, "
    "current, updated, or a=<a> of --modes), to split a "
    "study into runs that each fit the time at hand; "
    "--merge reports them together",
  )
  p.add_argument(
    "--merge",
    nargs="+",
    default=None,
    metavar="RESULTS_JSON",
    help="train nothing: report the runs of these results.json "
    "files (same task and settings; a method may lack an lr or "
    "seed, and comparisons pair the seeds both ran) as one run, "
    "into --out; --lr picks the main table's learning rate",
  )
  p.add_argument(
    "--measure-dx",
    action="store_true",
    help="record, per immediate layer and step, |dX_updated - "
    "dX_current| / |dX_current| for every immgrad method "
    "(measure_dx=True; one more input-gradient product per "
    "layer, in the timed steps); writes dx_change.png",
  )
  p.add_argument(
    "--step",
    choices=train_lib.STEPS,
    default="optax",
    help="how the immgrad methods' step is written: optax (default), "
    "value_and_grad + tx.update + apply_updates with shim(atomic=False); "
    "atomic, the same with the default atomic shim; in-place, "
    "immgrad.train_step with shim(atomic=False), each layer's new weights "
    "written over the old (no --measure-dx)",
  )
  p.add_argument(
    "--current-for",
    type=int,
    default=0,
    metavar="STEPS",
    help="every immgrad method takes its first STEPS steps in mode "
    "current (ordinary training) and its own mode after, in the same "
    "optimizer state: whether a mode's effect comes from the start of "
    "training",
  )
  p.add_argument(
    "--target",
    type=float,
    default=None,
    help="target loss for steps/seconds to target (default: "
    "the highest final smoothed training loss of the "
    "methods, which all of them reach; against plain, the "
    "higher of the method's and plain's on each seed)",
  )
  p.add_argument("--eval-every", type=int, default=None)
  p.add_argument(
    "--text",
    default=None,
    help="chars, deep_transformer and lm: train on this text "
    "file instead of the "
    "Python standard library's source",
  )
  p.add_argument(
    "--data",
    default=None,
    metavar="FOLDER",
    help="chars, deep_transformer and lm: train on the corpus in "
    "FOLDER (train.txt.xz and heldout.txt.xz, built by python -m "
    "immgrad.experiments.corpus build), each training byte at most "
    "once: a run that would need more is refused",
  )
  p.add_argument(
    "--quick",
    action="store_true",
    help="a short run (about a quarter of the steps)",
  )
  p.add_argument(
    "--out",
    default=None,
    help="output folder (default: a new folder named after the "
    "task and the time)",
  )
  p.add_argument("--no-progress", action="store_true")
  return p.parse_args(argv)


def training_devices(requested=None) -> list:
  """The devices to train on: ``requested`` many, or by default all local
  devices of the default backend (``CPU_DEVICES`` simulated ones where that
  is the CPU).
  """
  local = jax.local_devices()
  backend = jax.default_backend()
  n = requested or (CPU_DEVICES if backend == "cpu" else len(local))
  if len(local) < n:
    raise SystemExit(
      f"immgrad.experiments: --devices {n}, but the {backend} backend has "
      f"only {len(local)} local devices. Pass --devices {len(local)} (on "
      "the CPU, more devices must be asked for before JAX starts)."
    )
  return local[:n]


def main(argv=None):
  args = parse(argv)
  if args.merge:
    run, info = _load(args)
  else:
    run, info = _train(args)
  out = args.out or datetime.datetime.now().strftime(
    f"immgrad-experiment-{info['name']}-%Y%m%d-%H%M%S"
  )
  os.makedirs(out, exist_ok=True)
  return _report(args, run, info, out)


def _train(args):
  """Trains every lr x seed; returns ``{(lr, seed): runs}`` and settings."""
  try:
    jax.config.update("jax_num_cpu_devices", args.devices or CPU_DEVICES)
  except RuntimeError:  # The backend started before us: as it is.
    pass
  devices = training_devices(args.devices)
  if (args.size or args.remat or args.blocks or args.width) and (
    args.task != "lm"
  ):
    raise SystemExit(
      "immgrad.experiments: --size, --blocks, --width and --remat are for "
      "--task lm only."
    )
  if args.blocks is not None and args.blocks < 1:
    raise SystemExit(
      f"immgrad.experiments: --blocks {args.blocks}: give at least 1 (a "
      "model needs a block). Or leave --blocks out for the size's own "
      "number."
    )
  heads = tasks_lib.LM_SIZES[args.size or "tiny"][2] if args.width else 1
  if args.width is not None and (args.width < 1 or args.width % heads):
    raise SystemExit(
      f"immgrad.experiments: --width {args.width}: give a positive "
      f"multiple of {heads}, the number of heads of --size "
      f"{args.size or 'tiny'}. Or leave --width out for the size's own "
      "d_model."
    )
  if (args.text or args.data) and args.task not in tasks_lib.TEXT_TASKS:
    raise SystemExit(
      "immgrad.experiments: --text and --data are for the text tasks "
      f"({', '.join(tasks_lib.TEXT_TASKS)}) only."
    )
  if args.text and args.data:
    raise SystemExit("immgrad.experiments: give --text or --data, not both.")
  if args.task == "lm":
    task = tasks_lib.lm(
      args.text,
      args.size or "tiny",
      remat=args.remat,
      data=args.data,
      blocks=args.blocks,
      width=args.width,
    )
  elif args.task in tasks_lib.TEXT_TASKS:
    task = tasks_lib.TASKS[args.task](args.text, data=args.data)
  else:
    task = tasks_lib.TASKS[args.task]()
  optimizer = args.optimizer or task.default_optimizer
  modes = None
  if args.mode_sweep or args.modes:
    modes = list(
      dict.fromkeys([0.0] + [float(a) for a in (args.modes or DEFAULT_MODES)])
    )
  methods = train_lib.methods_of(modes)
  if args.methods:
    unknown = [m for m in args.methods if m not in methods]
    if unknown:
      raise SystemExit(
        f"immgrad.experiments: --methods {unknown} are not "
        f"among this run's methods {list(methods)}."
      )
    methods = {m: mode for m, mode in methods.items() if m in args.methods}
  steps, batch_size = SIZES[task.name][1 if args.quick else 0]
  steps = args.steps or steps
  if args.step == "in-place" and args.measure_dx:
    raise SystemExit(
      "immgrad.experiments: --measure-dx measures through "
      "immgrad.value_and_grad; --step in-place has no such channel. Measure "
      "with --step optax (the same arithmetic, optax's step)."
    )
  if not 0 <= args.current_for < steps:
    raise SystemExit(
      f"immgrad.experiments: --current-for {args.current_for} must be at "
      f"least 0 and less than the run's {steps} steps (it is how many of "
      "them the immgrad methods take in mode current)."
    )
  batch_size = args.batch_size or batch_size
  lr = args.lr or task.default_lr[optimizer]
  seeds = args.seeds or DEFAULT_SEEDS[args.quick]
  eval_every = args.eval_every or max(1, steps // 10)
  lrs = [lr]
  if args.lr_sweep:
    lrs = sorted(set(args.lrs or [lr * 2.0**k for k in range(-3, 4)]) | {lr})
  settings = dict(
    task=task.name,
    optimizer=optimizer,
    lr=lr,
    steps=steps,
    batch_size=batch_size,
    devices=len(devices),
    seeds=seeds,
    lrs=lrs,
    eval_every=eval_every,
    target=args.target,
    quick=args.quick,
    modes=modes,
    methods=list(methods),
    measure_dx=args.measure_dx,
    lr_sweep=args.lr_sweep,
    current_for=args.current_for,
    step=args.step,
  )
  if task.data is not None:
    settings["data"] = _data_record(task.data, steps, batch_size)
  settings["command"] = _command(args, settings)
  print(f"task: {task.description}", file=sys.stderr)
  print(f"settings: {settings}", file=sys.stderr)
  run = {}
  for run_lr in lrs:
    for seed in seeds:
      bar = _progress(
        args, total=steps, desc=f"{task.name} lr={run_lr:g} seed={seed}"
      )
      run[run_lr, seed] = train_lib.train(
        task,
        optimizer_name=optimizer,
        lr=run_lr,
        steps=steps,
        batch_size=batch_size,
        seed=seed,
        eval_every=eval_every,
        progress=bar,
        methods=methods,
        measure_dx=args.measure_dx,
        devices=devices,
        current_for=args.current_for,
        step_kind=args.step,
      )
      if bar is not None:
        bar.close()
  info = dict(
    name=task.name,
    description=task.description,
    loss_unit=task.loss_unit,
    settings=settings,
    machine=report.machine(),
  )
  return run, info


def _data_record(data: dict, steps: int, batch_size: int) -> dict:
  """What one run reads: the splits' sizes and sha256, the bytes it sees.

  ``bytes_seen_per_run`` counts every byte of every window it trains on
  (``seq + 1`` a window: the inputs and the last target);
  ``passes_over_train`` is that over the training split's size. From a
  corpus (``--data``) a run that would see a byte twice is refused.
  """
  windows = steps * batch_size
  record = dict(
    data,
    windows_per_run=windows,
    bytes_seen_per_run=windows * data["window_bytes"],
    passes_over_train=round(
      windows * data["window_bytes"] / data["train"]["bytes"], 4
    ),
  )
  if data["disjoint_windows"] and windows > data["train_windows"]:
    raise SystemExit(
      f"immgrad.experiments: {steps} steps of {batch_size} windows need "
      f"{windows:,} windows ({record['bytes_seen_per_run']:,} bytes); the "
      f"corpus' training split has {data['train_windows']:,} "
      f"({data['train']['bytes']:,} bytes): this run would see bytes "
      "twice. Train fewer steps, or build a larger corpus."
    )
  return record


def _command(args, settings: dict) -> str:
  """The one command that repeats this run, every default spelled out."""
  words = ["python -m immgrad.experiments", f"--task {args.task}"]
  if args.size or args.task == "lm":
    words.append(f"--size {args.size or 'tiny'}")
  if args.blocks:
    words.append(f"--blocks {args.blocks}")
  if args.width:
    words.append(f"--width {args.width}")
  if args.remat:
    words.append("--remat")
  if args.text:
    words.append(f"--text {args.text}")
  if args.data:
    words.append(f"--data {args.data}")
  words += [
    f"--optimizer {settings['optimizer']}",
    f"--lr {settings['lr']!r}",
    f"--steps {settings['steps']}",
    f"--batch-size {settings['batch_size']}",
    f"--devices {settings['devices']}",
    "--seeds " + " ".join(map(str, settings["seeds"])),
  ]
  if args.eval_every:
    words.append(f"--eval-every {args.eval_every}")
  if args.lr_sweep:
    words.append(
      "--lr-sweep"
      + (" --lrs " + " ".join(repr(x) for x in args.lrs) if args.lrs else "")
    )
  if args.mode_sweep and not args.modes:
    words.append("--mode-sweep")
  if args.modes:
    words.append("--modes " + " ".join(f"{a:g}" for a in args.modes))
  if args.methods:
    words.append("--methods " + " ".join(args.methods))
  if args.measure_dx:
    words.append("--measure-dx")
  if args.current_for:
    words.append(f"--current-for {args.current_for}")
  if args.step != "optax":
    words.append(f"--step {args.step}")
  if args.target is not None:
    words.append(f"--target {args.target:g}")
  return " ".join(words)


STEP_WORDS = {  # --step, as the report names it.
  "optax": "value_and_grad + tx.update + apply_updates, shim(atomic=False)",
  "atomic": "value_and_grad + tx.update + apply_updates, the atomic shim",
  "in-place": "immgrad.train_step, shim(atomic=False): weights in place",
}


def _current_for(settings: dict) -> int | None:
  """The file's ``--current-for``, or None where no method it trained
  takes a mode other than current (plain, a=0: unchanged by it).
  """
  moved = [
    m
    for m in settings["methods"]
    if m == "updated" or (m.startswith("a=") and float(m[2:]) != 0)
  ]
  return settings.get("current_for", 0) if moved else None


def _step_kind(settings: dict) -> str | None:
  """The file's ``--step``, or None where it trained plain alone."""
  immgrad_methods = [m for m in settings["methods"] if m != "plain"]
  return settings.get("step", "optax") if immgrad_methods else None


def _agreed(flag: str, of_file, paths: list, loaded: list):
  """The one value of ``flag`` the files it bears on share (``of_file``:
  a file's settings -> its value, or None where the flag does not bear
  on its methods); None if it bears on none.
  """
  values = {}
  for path, payload in zip(paths, loaded):
    value = of_file(payload["settings"])
    if value is not None:
      values[path] = value
  if len(set(values.values())) > 1:
    raise SystemExit(
      "immgrad.experiments --merge: the immgrad methods of these files "
      f"were run with different {flag} ({values}): only runs with the "
      "same settings merge."
    )
  return next(iter(values.values()), None)


def _load(args):
  """``--merge``: the runs of several results.json, as if run together."""
  loaded = [report.read_json(path) for path in args.merge]
  first = loaded[0]
  for path, other in zip(args.merge, loaded):
    for key in ("task", "loss_unit"):
      if other[key] != first[key]:
        raise SystemExit(
          f"immgrad.experiments --merge: {path} has {key} "
          f"{other[key]!r}, {args.merge[0]} {first[key]!r}: "
          "only runs of one task merge."
        )
    for key in ("task", "optimizer", "steps", "batch_size", "eval_every"):
      if other["settings"][key] != first["settings"][key]:
        raise SystemExit(
          f"immgrad.experiments --merge: {path} has {key} "
          f"{other['settings'][key]!r}, {args.merge[0]} "
          f"{first['settings'][key]!r}: only runs with the same settings "
          "merge."
        )
    if None in (_data_key(other), _data_key(first)):
      if _data_key(other) != _data_key(first):  # Made before it was kept.
        print(
          f"immgrad.experiments --merge: WARNING: {path} or "
          f"{args.merge[0]} does not record the data it read; merged as "
          "if the same.",
          file=sys.stderr,
        )
    elif _data_key(other) != _data_key(first):
      raise SystemExit(
        f"immgrad.experiments --merge: {path} read the data (train, "
        f"held-out sha256) {_data_key(other)}, {args.merge[0]} "
        f"{_data_key(first)}: only runs on the same data merge."
      )
  run, methods, modes = {}, {}, set()
  for path, payload in zip(args.merge, loaded):
    modes |= set(payload["settings"]["modes"] or [])
    for r in payload["runs"]:
      key = (r["lr"], r["seed"])
      if r["method"] in run.get(key, {}):
        raise SystemExit(
          f"immgrad.experiments --merge: {r['method']} at lr "
          f"{r['lr']:g}, seed {r['seed']} is in two of the "
          f"files (again in {path})."
        )
      methods[r["method"]] = True
      run.setdefault(key, {})[r["method"]] = train_lib.Run(
        r["method"],
        losses=r["losses"],
        seconds=r["seconds"],
        evals=r["evals"],
        diverged_at=r["summary"]["diverged_at"],
        compile_seconds=r["summary"]["compile_seconds"],
        dx_change=r.get("dx_change"),
      )
  methods = sorted(methods, key=lambda m: (m != "plain", m))
  for key, runs in sorted(run.items()):
    run[key] = {m: runs[m] for m in methods if m in runs}
  current_for = _agreed("--current-for", _current_for, args.merge, loaded)
  step_kind = _agreed("--step", _step_kind, args.merge, loaded)
  settings = dict(first["settings"])
  lrs = sorted({lr for lr, _ in run})
  settings.update(
    command=None,  # Each file's is in merged_from.
    lr=args.lr or settings["lr"],
    lrs=lrs,
    seeds=sorted({seed for _, seed in run}),
    methods=methods,
    modes=sorted(modes) or None,
    lr_sweep=len(lrs) > 1,
    current_for=current_for or 0,
    step=step_kind or "optax",
    measure_dx=any(r.dx_change for runs in run.values() for r in runs.values()),
    merged_from=[
      dict(path=p, command=x["settings"].get("command"), machine=x["machine"])
      for p, x in zip(args.merge, loaded)
    ],
  )
  if settings["lr"] not in lrs:
    raise SystemExit(
      f"immgrad.experiments --merge: --lr {settings['lr']:g} "
      f"is not among the runs' {lrs}."
    )
  info = dict(
    name=settings["task"],
    description=first["task"],
    loss_unit=first["loss_unit"],
    settings=settings,
    machine=first["machine"],
  )
  return run, info


def _data_line(data: dict | None) -> list[str]:
  if data is None:
    return []
  seen = data["bytes_seen_per_run"]
  how = (
    "each at most once"
    if data["disjoint_windows"]
    else "random windows, bytes repeat"
  )
  return [
    f"data: {seen:,} bytes seen a run ({how}), "
    f"{data['passes_over_train']:.3g} passes over the "
    f"{data['train']['bytes']:,} training bytes; "
    f"{data['heldout']['bytes']:,} held out"
  ]


def _coverage_lines(run: dict, methods: list) -> list[str]:
  """Which seeds each method ran at each lr, where not every method ran at
  every lr and seed (a merge of runs made apart); else nothing.

  >>> run = {(0.1, 0): {"plain": 0, "a=1": 0}, (0.1, 1): {"plain": 0},
  ...        (0.2, 0): {"a=1": 0}}
  >>> for line in _coverage_lines(run, ["plain", "a=1"]):
  ...   print(line)
  runs, not every method at every lr and seed (comparisons pair seeds):
    lr 0.1: plain seeds 0, 1; a=1 seed 0
    lr 0.2: a=1 seed 0
  """
  seeds = sorted({seed for _, seed in run})
  lrs = sorted({lr for lr, _ in run})
  if all(
    len(run.get((lr, s), {})) == len(methods) for lr in lrs for s in seeds
  ):
    return []
  lines = [
    "runs, not every method at every lr and seed (comparisons pair seeds):"
  ]
  for lr in lrs:
    cells = []
    for m in methods:
      ran = [str(s) for s in seeds if m in run.get((lr, s), {})]
      if ran:
        word = "seed" if len(ran) == 1 else "seeds"
        cells.append(f"{m} {word} {', '.join(ran)}")
    lines.append(f"  lr {lr:g}: " + "; ".join(cells))
  return lines


def _data_key(payload: dict):
  """The training and held-out sha256 a run read (None: not recorded)."""
  data = payload["settings"].get("data")
  if data is None:
    return None
  return (data["train"]["sha256"], data["heldout"]["sha256"])


def _report(args, run, info, out):
  """Summaries, tables, checks, results.json and plots of ``run``."""
  settings, unit, name = info["settings"], info["loss_unit"], info["name"]
  lr, steps, methods = settings["lr"], settings["steps"], settings["methods"]
  records, sanity, aggregates, summaries, lags = [], [], {}, {}, {}
  by_seed = {}  # lr -> seed -> method -> (Run, summary).
  for (run_lr, seed), runs in sorted(run.items()):
    per_method = summaries.setdefault(run_lr, {m: [] for m in methods})
    target = args.target or report.default_target(runs, steps)
    for method, r in runs.items():
      summary = report.summarise(r, runs.get("plain"), steps, target)
      summary["target"] = target
      per_method[method].append(summary)
      by_seed.setdefault(run_lr, {}).setdefault(seed, {})[method] = (
        r,
        summary,
      )
      if "plain" in runs and method != "plain":
        lags.setdefault(run_lr, {}).setdefault(method, []).append(
          report.steps_behind(r.losses, runs["plain"].losses, steps)
        )
      record = dict(
        lr=run_lr,
        seed=seed,
        method=method,
        losses=r.losses,
        seconds=r.seconds,
        evals=r.evals,
        summary=summary,
      )
      if r.dx_change is not None:
        record["dx_change"] = r.dx_change
        summary["dx"] = report.dx_summary(r.dx_change, r.diverged_at)
      records.append(record)
    if "plain" in runs and report.reference_method(runs) in runs:
      sanity.append(dict(lr=run_lr, seed=seed, **report.sanity(runs)))
  for run_lr, per_method in summaries.items():
    summaries[run_lr] = {m: ss for m, ss in per_method.items() if ss}
    aggregates[run_lr] = {
      m: report.aggregate(
        [{k: v for k, v in s.items() if k != "dx"} for s in ss]
      )
      for m, ss in summaries[run_lr].items()
    }

  main_records = [r for r in records if r["lr"] == lr]
  coverage = _coverage_lines(run, methods)
  text = [
    f"## {info['description']}",
    f"{settings['optimizer']}, lr {lr:g}, {steps} steps, batch "
    f"{settings['batch_size']} over {settings['devices']} devices, "
    f"seeds {settings['seeds']}",
    *_data_line(settings.get("data")),
    *coverage,
    *(
      [
        f"every immgrad method in mode current for its first "
        f"{settings['current_for']} steps, its own mode after"
      ]
      if settings.get("current_for")
      else []
    ),
    f"immgrad's step: {STEP_WORDS[settings.get('step', 'optax')]}",
    "",
    report.table(aggregates[lr], unit),
    "",
  ]
  checks = [s for s in sanity if s["lr"] == lr]
  passed = all(s["passed"] for s in checks)
  if checks:
    worst = max(s["max_relative_loss_difference_first_steps"] for s in checks)
    whole = max(s["max_relative_loss_difference_whole_run"] for s in checks)
    text.append(
      f"Sanity check ({checks[0]['reference']} reproduces plain): "
      f"{'PASSED' if passed else 'FAILED'}: largest relative loss "
      f"difference {worst:.2g} over the first {report.SANITY_STEPS} steps "
      f"(must be <= {report.SANITY_RTOL:g}); {whole:.2g} over the whole "
      "run."
    )
  else:
    text.append(
      "Sanity check: not run (it needs plain and current or a=0; "
      "merge runs that have them with --merge)."
    )
  if lags.get(lr):
    text += ["", report.lag_table(lags[lr], steps)]
  against = {
    lr_value: stats.against_plain(per_seed, steps, args.target)
    for lr_value, per_seed in sorted(by_seed.items())
  }
  for lr_value, comparison in against.items():
    if comparison:
      text += ["", stats.table(comparison, f"lr {lr_value:g}")]
  tuned = None
  if len(by_seed) > 1:
    best, per_seed = stats.tuned(by_seed)
    if "plain" in best and per_seed:
      tuned = dict(
        best_lr=best,
        comparison=stats.against_plain(per_seed, steps, args.target),
      )
      where = (
        "each at its own best lr ("
        + ", ".join(f"{m} {v:g}" for m, v in best.items())
        + "; best: lowest final held-out loss, mean over seeds)"
      )
      text += ["", stats.table(tuned["comparison"], where)]
  if any(against.values()):
    text += ["", stats.legend(unit, args.target)]
  sweep = None
  if settings["lr_sweep"]:
    sweep = _sweep(aggregates, methods)
    text += [
      "",
      _sweep_table(sweep, aggregates, methods, report.did_not_learn(records)),
    ]
  mode_sweep = None
  if settings["modes"] is not None and "a=0" in methods:
    if coverage:
      text += [
        "",
        "Mode sweep: not run (it pairs every method with a=0 seed by seed, "
        "and not every method ran at every lr and seed).",
      ]
    else:
      mode_sweep, mode_text = _mode_sweep(
        summaries, lr, sweep, methods, name, settings["optimizer"], unit
      )
      text += ["", mode_text]
  dx_rows = None
  if settings["measure_dx"]:
    dx_rows = _dx_rows(summaries, methods)
    text += ["", report.dx_table(dx_rows)]
  text += ["", report.DEFINITIONS.strip()]
  if settings.get("command"):
    text += ["", f"Repeat this run with: {settings['command']}"]
  elif settings.get("merged_from"):
    text += ["", "Repeat these runs with (then --merge their results.json):"]
    text += [
      f"  {x['command']}" for x in settings["merged_from"] if x["command"]
    ]
  print("\n".join(text))

  report.write_json(
    os.path.join(out, "results.json"),
    dict(
      settings=settings,
      task=info["description"],
      loss_unit=unit,
      machine=info["machine"],
      aggregates={str(k): v for k, v in aggregates.items()},
      sanity=sanity,
      lr_sweep=sweep,
      mode_sweep=mode_sweep,
      dx_change=dx_rows,
      steps_behind_plain={
        str(k): dict(at_steps=report.lag_steps(steps), per_seed=v)
        for k, v in lags.items()
      },
      against_plain={str(k): v for k, v in against.items()},
      against_plain_tuned=tuned,
      runs=[report.rounded_run(r) for r in records],
    ),
  )
  report.plot(
    os.path.join(out, "loss_curves.png"),
    main_records,
    steps,
    unit,
    f"{name}: {settings['optimizer']} lr {lr:g}, seeds {settings['seeds']}",
  )
  written = ["results.json", "loss_curves.png"]
  written += _study_figures(
    out,
    records,
    against,
    tuned and tuned["best_lr"],
    unit,
    f"{name}: {settings['optimizer']}, seeds {settings['seeds']}",
  )
  if settings["measure_dx"]:
    report.plot_dx(
      os.path.join(out, "dx_change.png"),
      records,
      f"{name}: {settings['optimizer']}",
    )
    written.append("dx_change.png")
  print(f"\nwrote {', '.join(f'{out}/{w}' for w in written)}")
  return 0 if passed else 1


def _study_figures(out, records, against, best, unit, title) -> list[str]:
  """Held-out curves (per lr, and each method at its ``best`` lr where
  those differ), held-out loss against lr (several lrs) and steps to
  target (where plain ran): the files written.
  """
  written = []
  if any(report.heldout(r)[1] for r in records):
    lrs = sorted({r["lr"] for r in records})
    report.plot_heldout(
      os.path.join(out, "heldout_curves.png"),
      {f"lr {lr:g}": [r for r in records if r["lr"] == lr] for lr in lrs},
      unit,
      title,
    )
    written.append("heldout_curves.png")
    if best and len(set(best.values())) > 1:
      where = ", ".join(f"{m} {lr:g}" for m, lr in best.items())
      report.plot_heldout(
        os.path.join(out, "heldout_curves_tuned.png"),
        {
          f"each at its best lr: {where}": [
            r for r in records if best.get(r["method"]) == r["lr"]
          ]
        },
        unit,
        title,
      )
      written.append("heldout_curves_tuned.png")
    if len(lrs) > 1:
      report.plot_against_lr(
        os.path.join(out, "heldout_against_lr.png"),
        stats.against_lr(records),
        unit,
        title,
        report.did_not_learn(records, report.heldout),
      )
      written.append("heldout_against_lr.png")
  if any(against.values()):
    report.plot_steps_to_target(
      os.path.join(out, "steps_to_target.png"), against, title
    )
    written.append("steps_to_target.png")
  return written


def _mode_sweep(summaries, lr, sweep, methods, name, optimizer, unit):
  """The mode sweep's tables: at the main lr, at each lr, and each tuned."""
  out, texts = {}, []
  head = f"{name}, {optimizer}"
  lrs = sorted(summaries) if sweep else [lr]
  for lr_value in lrs:
    t, result = report.mode_table(
      summaries[lr_value],
      unit,
      f"Mode sweep, {head}, lr {lr_value:g}: final losses over seeds, "
      "and the paired difference from a=0 (positive: better than a=0).",
    )
    out[str(lr_value)] = result
    texts.append(t)
  if sweep:  # Each method at its own best learning rate.
    tuned = {}
    for m in methods:
      best = sweep[m]["best_lr"]
      tuned[m] = (
        summaries[best][m] if best is not None else summaries[lrs[0]][m]
      )
    t, result = report.mode_table(
      tuned,
      unit,
      f"Mode sweep, {head}, each method at its own best lr ("
      + ", ".join(
        f"{m} {sweep[m]['best_lr']:g}" if sweep[m]["best_lr"] else f"{m} -"
        for m in methods
      )
      + ").",
    )
    out["tuned"] = result
    texts.append(t)
  return out, "\n\n".join(texts)


def _dx_rows(summaries, methods):
  rows = []
  for lr_value in sorted(summaries):
    for m in methods:
      ss = summaries[lr_value].get(m, [])
      if not any("dx" in s for s in ss):
        continue
      rows.append(
        {
          "lr": lr_value,
          "method": m,
          "diverged_at": [
            s["diverged_at"] for s in ss if s["diverged_at"] is not None
          ],
          "summaries": [s.get("dx") for s in ss],
        }
      )
  return rows


def _progress(args, total, desc):
  if args.no_progress:
    return None
  from tqdm import tqdm

  return tqdm(total=total, desc=desc, leave=False, dynamic_ncols=True)


def _finals(aggregates, method) -> dict:
  """lr -> ``method``'s mean final smoothed training loss, where no run
  diverged.
  """
  return {
    lr_value: by_method[method]["final_smoothed_train_loss"]["mean"]
    for lr_value, by_method in aggregates.items()
    if method in by_method
    and not by_method[method]["diverged_runs"]
    and by_method[method]["final_smoothed_train_loss"] is not None
  }


def _sweep(aggregates, methods):
  """Per method: the best learning rate, and the lowest that diverges."""
  out = {}
  for method in methods:
    finals = _finals(aggregates, method)
    diverging = [
      lr_value
      for lr_value, by_method in aggregates.items()
      if method in by_method and by_method[method]["diverged_runs"]
    ]
    out[method] = {
      "best_lr": min(finals, key=finals.__getitem__) if finals else None,
      "best_final_smoothed_train_loss": min(finals.values())
      if finals
      else None,
      "lowest_diverging_lr": min(diverging) if diverging else None,
    }
  return out


def _sweep_table(sweep, aggregates, methods, stalled):
  """The learning-rate sweep's table and each method's best and lowest
  diverging rate; ``stalled``: the ``(method, lr)`` that did not learn
  (``report.did_not_learn``).
  """
  methods = list(methods)
  rows = [
    "Learning-rate sweep: final smoothed training loss (mean over "
    "seeds), or the step it diverged at.",
    "",
    "| lr | " + " | ".join(methods) + " |",
    "|" + " --- |" * (len(methods) + 1),
  ]
  marked = False
  for lr_value in sorted(aggregates):
    cells = []
    for m in methods:
      agg = aggregates[lr_value].get(m)
      if agg is None:
        cells.append("not run")
      elif agg["diverged_runs"]:
        cells.append(
          "diverged at step " + ", ".join(str(s) for s in agg["diverged_at"])
        )
      else:
        cell = report._cell(agg["final_smoothed_train_loss"])
        if (m, lr_value) in stalled:
          cell, marked = cell + " (did not learn)", True
        cells.append(cell)
    rows.append(f"| {lr_value:g} | " + " | ".join(cells) + " |")
  if marked:
    rows += [
      "",
      "did not learn: a final loss above the lowest any method had at "
      "its learning rate a fifth of the way into the run (no NaN, so not "
      "counted as diverged).",
    ]
  rows.append("")
  for m in methods:
    s = sweep[m]
    best = "-" if s["best_lr"] is None else f"{s['best_lr']:g}"
    div = (
      "none of those tried"
      if s["lowest_diverging_lr"] is None
      else f"{s['lowest_diverging_lr']:g}"
    )
    rows.append(f"- {m}: best lr {best}, lowest diverging lr {div}")
  return "\n".join(rows)


if __name__ == "__main__":
  sys.exit(main())
