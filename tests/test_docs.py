"""The Python examples of the documentation pages run as written.

Each page of ``docs/`` is read top to bottom: its ```python blocks run in
order in one namespace, which starts as the README's training step left it
(the guide pages continue it: ``dense``, ``loss_fn``, ``tx``, ``params``
...). A block the page marks ``<!-- not run: REASON -->`` on the line above
is a fragment of the reader's own program (their model, their data) and is
skipped; every other block must run. Pages that need an optional library
(Flax, Equinox, orbax) skip when it is not installed, as in CI's minimum
pass.
"""

import os
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
BLOCK = re.compile(
  r"^(<!-- not run: (.+?) -->\n)?```python\n(.*?)^```$", re.S | re.M
)
OPTIONAL = ("flax", "equinox", "orbax")


def blocks(path):
  """``(code, reason)`` of each python block; ``reason`` None: it runs."""
  return [(m.group(3), m.group(2)) for m in BLOCK.finditer(path.read_text())]


@pytest.fixture(scope="module")
def readme_scope():
  """The names the README's training step leaves (run once: it compiles)."""
  code, reason = blocks(ROOT / "README.md")[0]
  assert reason is None
  scope = {}
  exec(code, scope)
  return scope


PAGES = sorted(
  p.relative_to(DOCS).as_posix()
  for p in DOCS.rglob("*.md")
  if any(reason is None for _, reason in blocks(p))
)


def test_the_pages_have_runnable_examples():
  # Guards the block pattern: a change that found no block would pass below.
  assert {
    "training-step.md",
    "haiku.md",
    "equinox.md",
    "stacked.md",
    "data-parallel.md",
    "optimizer.md",
  } <= set(PAGES)
  every = sum((blocks(p) for p in DOCS.rglob("*.md")), [])
  fences = sum(p.read_text().count("```python") for p in DOCS.rglob("*.md"))
  assert len(every) == fences, "a ```python block the pattern does not read"


@pytest.mark.parametrize("page", PAGES)
def test_page_examples_run(page, readme_scope, tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)  # An example that writes files writes here.
  scope = dict(readme_scope)  # Each page continues the README on its own.
  for code, reason in blocks(DOCS / page):
    if reason is not None:
      continue
    try:
      exec(compile(code, f"docs/{page}", "exec"), scope)
    except ModuleNotFoundError as e:
      if e.name and e.name.split(".")[0] in OPTIONAL:
        pytest.skip(f"docs/{page} needs {e.name}, which is not installed")
      raise


def _links(path):
  text = re.sub(r"^```.*?^```$", "", path.read_text(), flags=re.S | re.M)
  return re.findall(r"\]\(([^)\s]+)\)", text)


def _anchors(path):
  """GitHub's and MkDocs' anchors of a page's headings."""
  text = re.sub(r"^```.*?^```$", "", path.read_text(), flags=re.S | re.M)
  return {
    re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
    for h in re.findall(r"^#+ (.*)$", text, re.M)
  }


@pytest.mark.parametrize(
  "path",
  ["README.md"]
  + [os.path.join("docs", p.relative_to(DOCS)) for p in DOCS.rglob("*.md")],
)
def test_relative_links_reach_a_file_and_heading(path):
  path = ROOT / path
  for link in _links(path):
    if re.match(r"[a-z]+:", link):
      continue  # http:, https:, mailto:
    target, _, anchor = link.partition("#")
    target = (path.parent / target).resolve() if target else path
    assert target.exists(), f"{path.name} links to {link}: no such file"
    if anchor and target.suffix == ".md":
      assert anchor in _anchors(target), (
        f"{path.name} links to {link}: no such heading"
      )
