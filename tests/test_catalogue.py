"""The optax catalogue as a test (issue 14, point 1).

Every GradientTransformation factory the installed optax exports (top level
and ``optax.contrib``, discovered by ``catalogue.discover``, not listed by
hand) goes through ``immgrad.shim``:

* a per-parameter rule must train like plain ``jax.value_and_grad`` +
  optax for ``catalogue.STEPS`` steps in ``mode="current"``, compared in
  float64 to ``catalogue.F64_TOL`` (1e-10), so that a real difference
  cannot hide behind float32 rounding. The float32 run is compared too, to
  ``catalogue.F32_TOL``; a rule that leaves it (radam and contrib.cocob
  amplify rounding that way) passes only because float64 agrees, and the
  test reports it as amplified rounding, not as a bug;
* a whole-tree rule must be refused with a ValueError naming it, and must
  indeed train differently leaf by leaf (or be whole-tree for a reason a
  clean run does not show: ``catalogue.SEMANTIC``);
* a rule whose update needs extra arguments (``value``, ``value_fn``,
  per-example gradients, ...) must be listed in ``catalogue.EXTRA_ARGS``,
  must fail without them and train with them in plain optax;
* a case with a params-shaped option (a mask tree, labels) or a PRNG key
  in its state must be accepted and equal plain training like any
  per-parameter rule; a refusal of one fails (``catalogue.WRONGLY_REFUSED``).

Each run is compiled once per case and dtype (``lax.scan`` over the
steps); float64 runs in its own process (``JAX_ENABLE_X64=1``) so it never
leaks into the other test modules, float32 (the rules, not their
params-shaped variants) in a second process alongside.
"""

import os
import tempfile

import jax
import pytest

import catalogue

CASES, UNCLASSIFIED = catalogue.discover()
# CATALOGUE_ONLY=adam,contrib.cocob runs those cases only (while working
# on them; the discovery test then fails, as it should).
ONLY = os.environ.get("CATALOGUE_ONLY")
BY_NAME = {
  case.name: case for case in CASES if not ONLY or case.name in ONLY.split(",")
}


@pytest.fixture(scope="module")
def results():
  """``{"float64": {case: result}, "float32": {...}}``, from subprocesses."""
  with tempfile.TemporaryDirectory() as tmp:
    runs = {}
    for dtype in ("float64", "float32"):
      out = os.path.join(tmp, f"{dtype}.json")
      runs[dtype] = (
        catalogue.start_subprocess(
          dtype, out, only_accepted=dtype == "float32", only=ONLY
        ),
        out,
      )
    got = {
      dtype: catalogue.finish_subprocess(proc, out)
      for dtype, (proc, out) in runs.items()
    }
  for dtype, run in got.items():
    assert run["dtype"] == dtype
  return {dtype: run["results"] for dtype, run in got.items()}


def test_discovery_finds_the_catalogue():
  assert not UNCLASSIFIED, (
    "optax exports callables the catalogue cannot classify (build them "
    f"via catalogue.ARGS, or name them in NOT_RULES): {UNCLASSIFIED}"
  )
  names = {case.name for case in CASES}
  assert not ONLY, "CATALOGUE_ONLY is set: the catalogue ran in part"
  for known in (
    "adam",
    "sgd",
    "clip_by_global_norm",
    "chain",
    "MultiSteps",
    "inject_hyperparams",
    "masked",
    "contrib.cocob",
    "contrib.prodigy",
    "contrib.muon",
    "adamw(mask=tree)",
  ):
    assert known in names
  assert len([c for c in CASES if not c.variant]) >= 100


def test_every_case_has_a_status(results):
  """A new optax rule without a decision fails here, all listed at once."""
  f64 = results["float64"]
  assert set(f64) == set(BY_NAME)
  statuses = catalogue.classify(f64)
  undecided = {
    name: {
      k: v
      for k, v in f64[name].items()
      if k.endswith("error") or k in ("shim", "message", "needs_more")
    }
    for name, st in statuses.items()
    if st is None
  }
  assert not undecided, f"cases without a status: {undecided}"
  silent = [name for name, st in statuses.items() if st == catalogue.SILENT]
  assert not silent, f"accepted by the shim but training differently: {silent}"
  refused = {
    name: f64[name]["message"]
    for name, st in statuses.items()
    if st == catalogue.WRONGLY_REFUSED
  }
  assert not refused, f"per-parameter, yet refused by the shim: {refused}"


def test_extra_arguments_are_the_rules_that_need_them(results):
  """EXTRA_ARGS lists exactly the rules whose plain update fails without."""
  f64 = results["float64"]
  need = {r["rule"] for r in f64.values() if r.get("needs_more")}
  assert need == set(catalogue.EXTRA_ARGS), (
    f"need extra arguments, not listed: {need - set(catalogue.EXTRA_ARGS)}; "
    f"listed, not needed: {set(catalogue.EXTRA_ARGS) - need}"
  )


# Known shortfalls, each a strict expected failure until it is fixed.
KNOWN = {
  "measure_with_ema": "optax builds it as a plain chain(stateless, ema): "
  "nothing in the transformation carries its name, "
  "so the refusal names its parts ('chain: "
  "stateless')",
}


@pytest.mark.parametrize(
  "name",
  [
    pytest.param(n, marks=pytest.mark.xfail(strict=True, reason=KNOWN[n]))
    if n in KNOWN
    else n
    for n in sorted(BY_NAME)
  ],
)
def test_case(name, results):
  r64 = results["float64"][name]
  status = catalogue.classify(results["float64"])[name]
  label = catalogue.display(r64)
  assert status in catalogue.STATUSES, f"{label}: {status}: {r64}"
  if status == catalogue.PER_PARAMETER:
    assert r64["shim"] == "accepted"
    assert r64["shim_err"] <= catalogue.F64_TOL, r64
    assert not r64["f32_state"], (
      f"{label}: float32 state in the float64 run (give it the run's "
      f"dtype in catalogue.ARGS): {r64['f32_state']}"
    )
    if r64.get("variant"):
      return  # Float32 runs the rules themselves only.
    r32 = results["float32"][name]
    assert r32["shim"] == "accepted", (
      f"{label}: accepted in float64, not in float32: {r32['message']}"
    )
    assert "shim_err" in r32, r32
    if r32["shim_err"] > catalogue.F32_TOL:
      # Amplified rounding: float64 agrees to F64_TOL (checked above).
      print(
        f"{label}: float32 differs by {r32['shim_err']:.2g} after "
        f"{catalogue.STEPS} steps, float64 by {r64['shim_err']:.2g}: "
        "amplified rounding"
      )
  elif status == catalogue.WHOLE_TREE:
    assert r64["shim"] == "refused", r64
    assert catalogue.short_name(r64["rule"]) in r64["message"], (
      f"{label}: the refusal does not name the rule: {r64['message']}"
    )
    if r64["rule"] not in catalogue.SEMANTIC and not r64.get("variant"):
      assert r64["leafwise_err"] > catalogue.WHOLE_TREE_MIN, r64
  elif status == catalogue.EXTRA:
    assert r64["with_extras_finite"], (
      f"{label}: plain training given "
      f"{catalogue.EXTRA_ARGS[r64['rule']]} fails: {r64}"
    )
    assert r64["shim"] != "accepted", (
      f"{label}: the shim accepts a rule whose update needs "
      f"{catalogue.EXTRA_ARGS[r64['rule']]}, and passes none of it"
    )


WRAPPERS = sorted(
  c.name
  for c in BY_NAME.values()
  if c.wrapper and not c.variant and catalogue.wrapped_slot(c)
)
WHOLE_TREE_INNER = "clip_by_global_norm"


@pytest.mark.parametrize("name", WRAPPERS)
def test_wrapper_does_not_hide_a_whole_tree_rule(name):
  """Around ``clip_by_global_norm``, every wrapper is refused, naming it."""
  import optax

  case = BY_NAME[name]
  inner = optax.chain(optax.clip_by_global_norm(0.05), optax.sgd(1e-2))
  tx = catalogue.build(case, inner=inner)
  verdict, message = catalogue._verdict(tx)
  assert verdict != "accepted", f"{name} around {WHOLE_TREE_INNER} accepted"
  if verdict == "refused" and case.rule not in catalogue.EXTRA_ARGS:
    assert (
      WHOLE_TREE_INNER in message or catalogue.short_name(case.rule) in message
    ), message


def test_float64_stays_in_its_process(results):
  del results
  assert not jax.config.jax_enable_x64
  assert jax.numpy.ones(()).dtype == jax.numpy.float32


def test_docs_table_is_the_catalogue(results):
  """docs/optimizer.md holds ``catalogue.readme_table()`` between markers."""
  path = os.path.join(
    os.path.dirname(__file__), os.pardir, "docs", "optimizer.md"
  )
  with open(path) as f:
    text = f.read()
  start, end = catalogue.README_MARKERS
  assert start in text and end in text, (
    "docs/optimizer.md lacks the table markers"
  )
  table = text.split(start, 1)[1].split(end, 1)[0].strip("\n") + "\n"
  assert table == catalogue.readme_table(results["float64"]), (
    "docs/optimizer.md's table is stale: run "
    "`python tests/catalogue.py --readme`"
  )
