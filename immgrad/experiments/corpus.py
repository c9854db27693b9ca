"""The ``lm`` task's English corpus, from Debian's documentation packages.

``python -m immgrad.experiments.corpus build --out data/corpus``: the HTML
pages' prose, repeated paragraphs dropped, whole pages held out; written as
``train.txt.xz``, ``heldout.txt.xz`` and ``manifest.json`` for ``--data``.
"""

import argparse
import dataclasses
import hashlib
import html
import html.parser
import io
import json
import lzma
import os
import re
import subprocess
import sys
import tarfile
import tempfile
import time
from typing import Iterable, Iterator

# Paragraphs at least this long are kept only the first time they occur.
DEDUPE_CHARS = 64
# A document with less text than this after cleaning is dropped.
MIN_DOCUMENT_BYTES = 200
# A document with a smaller share of ASCII bytes is dropped (translations).
MIN_ASCII = 0.9
HELDOUT_BYTES = 1_500_000
XZ_PRESET = 9
SEPARATOR = "\n\n"  # Between documents in a split's text.


@dataclasses.dataclass(frozen=True)
class Source:
  """One Debian package: which of its files are read, and its licence."""

  package: str
  version: str  # The version the recorded corpus was built from.
  licence: str  # As its copyright file gives it for the files read.
  root: str  # The folder of its HTML pages inside the package.
  exclude: tuple[str, ...] = ()  # Regular expressions on the page's path.


_SPHINX_PAGES = (r"(^|/)(genindex|search|py-modindex|modindex)[^/]*\.html$",)
SOURCES = (
  Source(
    "linux-doc-6.1",
    "6.1.192-3",
    "GPL-2 (Debian copyright file, Files: *)",
    "usr/share/doc/linux-doc-6.1/html/",
    _SPHINX_PAGES + (r"^translations/",),
  ),
  Source(
    "python3.11-doc",
    "3.11.2-6+deb12u9",
    "PSF-2.0 (Python Software Foundation License)",
    "usr/share/doc/python3.11/html/",
    _SPHINX_PAGES,
  ),
  Source(
    "postgresql-doc-15",
    "15.20-0+deb12u1",
    "PostgreSQL (Debian copyright file, Files: *)",
    "usr/share/doc/postgresql-doc-15/html/",
    (r"^(bookindex|index)\.html$",),
  ),
  Source(
    "erlang-doc",
    "1:25.2.3+dfsg-1+deb12u4",
    "Apache-2.0 (Debian copyright file, Files: *)",
    "usr/share/doc/erlang-doc/",
  ),
  Source(
    "python-django-doc",
    "3:3.2.25-0+deb12u7",
    "BSD-3-Clause (Debian copyright file, Files: *)",
    "usr/share/doc/python-django-doc/html/",
    _SPHINX_PAGES,
  ),
  Source(
    "python-sqlalchemy-doc",
    "1.4.46+ds1-1",
    "Expat (MIT; Debian copyright file, Files: *)",
    "usr/share/doc/python-sqlalchemy-doc/html/",
    _SPHINX_PAGES,
  ),
  Source(
    "python-sympy-doc",
    "1.11.1-1",
    "BSD-3-Clause (Debian copyright file, Files: *)",
    "usr/share/doc/python-sympy-doc/html/",
    _SPHINX_PAGES,
  ),
)


# -- reading a .deb ---------------------------------------------------------


def _ar_member(path: str, prefix: str) -> bytes:
  """The first member of the ``ar`` archive ``path`` named ``prefix*``."""
  with open(path, "rb") as f:
    if f.read(8) != b"!<arch>\n":
      raise ValueError(f"{path} is not a .deb (no ar archive header).")
    while header := f.read(60):
      name = header[:16].decode().strip().rstrip("/")
      size = int(header[48:58])
      if name.startswith(prefix):
        return f.read(size)
      f.seek(size + size % 2, 1)
  raise ValueError(f"{path} has no {prefix}* member.")


def deb_members(path: str) -> Iterator[tuple[str, bytes]]:
  """``(path, bytes)`` of each regular file of a ``.deb``'s data archive.

  A ``.deb`` is an ``ar`` archive holding ``data.tar.xz`` (or ``.gz``,
  ``.bz2``, uncompressed); read here with the standard library alone.
  Paths lose their leading ``./``.
  """
  data = io.BytesIO(_ar_member(path, "data.tar"))
  with tarfile.open(fileobj=data, mode="r:*") as tar:
    for member in tar:
      file = member.isfile() and tar.extractfile(member)
      if file:
        yield member.name.removeprefix("./"), file.read()


def deb_version(path: str) -> str:
  """The ``Version:`` of a ``.deb``'s control file."""
  control = io.BytesIO(_ar_member(path, "control.tar"))
  with tarfile.open(fileobj=control, mode="r:*") as tar:
    for member in tar:
      if member.name.removeprefix("./") != "control":
        continue
      file = tar.extractfile(member)
      text = file.read().decode() if file else ""
      if found := re.search(r"^Version: *(\S+)", text, re.M):
        return found.group(1)
  raise ValueError(f"{path} has no control file with a Version line.")


# -- HTML to text -----------------------------------------------------------

_SKIP_TAGS = {
  "script", "style", "head", "nav", "aside", "pre", "footer", "header", "form",
  "button", "select", "textarea", "title", "noscript", "svg", "math",
}  # fmt: skip
_SKIP_CLASSES = {
  "sphinxsidebar", "related", "footer", "navheader", "navfooter",
  "headerlink", "breadcrumbs", "wy-breadcrumbs", "rst-footer-buttons",
  "highlight", "toctree-wrapper", "toc", "navigation", "copy-button",
  "nav", "topbar", "title-anchors",
}  # fmt: skip
_SKIP_IDS = {"hd", "ft", "global-nav", "leftnav", "sidebar"}
_SKIP_ROLES = {"navigation", "search", "banner", "contentinfo"}
_BLOCK_TAGS = {
  "p", "div", "section", "article", "h1", "h2", "h3", "h4", "h5", "h6",
  "li", "dt", "dd", "tr", "table", "blockquote", "ul", "ol", "dl", "br",
  "hr", "caption", "figure", "figcaption", "body", "main",
}  # fmt: skip
_VOID_TAGS = {"br", "hr", "img", "meta", "link", "input", "wbr", "col"}


class _Text(html.parser.HTMLParser):
  """The text of a page's main content, a paragraph per block element."""

  def __init__(self, main_only: bool):
    super().__init__(convert_charrefs=True)
    self.parts: list[str] = []
    self._skip: list[tuple[str, int]] = []  # (tag, depth of that tag)
    self._main: tuple[str, int] | None = None
    self._capturing = not main_only
    self._depth: dict[str, int] = {}

  def handle_starttag(self, tag, attrs):
    if tag in _VOID_TAGS:
      if tag in ("br", "hr"):
        self.parts.append("\n\n")
      return
    depth = self._depth[tag] = self._depth.get(tag, 0) + 1
    attrs = dict(attrs)
    classes = set((attrs.get("class") or "").split())
    if not self._capturing and attrs.get("role") == "main":
      self._capturing, self._main = True, (tag, depth)
    if not self._skip and (
      tag in _SKIP_TAGS
      or classes & _SKIP_CLASSES
      or attrs.get("id") in _SKIP_IDS
      or attrs.get("role") in _SKIP_ROLES
    ):
      self._skip.append((tag, depth))
    if tag in _BLOCK_TAGS:
      self.parts.append("\n\n")

  def handle_endtag(self, tag):
    if tag in _VOID_TAGS:
      return
    depth = self._depth.get(tag, 0)
    if depth == 0:  # A stray end tag.
      return
    self._depth[tag] = depth - 1
    if self._skip and self._skip[-1] == (tag, depth):
      self._skip.pop()
    if self._main == (tag, depth):
      self._capturing, self._main = False, None
    if tag in _BLOCK_TAGS:
      self.parts.append("\n\n")

  def handle_data(self, data):
    if self._capturing and not self._skip:
      self.parts.append(data)


def html_text(page: str) -> str:
  """The prose of an HTML page: its ``role="main"`` element where it has
  one (Sphinx's themes), else its body, without navigation, sidebars,
  headers and footers, scripts, styles and ``<pre>`` (code) blocks;
  paragraphs (one per block element) separated by a blank line, the
  whitespace inside each collapsed to single spaces.
  """
  parser = _Text(main_only=re.search(r"role=[\"']main[\"']", page) is not None)
  parser.feed(page)
  parser.close()
  return "\n\n".join(paragraphs("".join(parser.parts)))


def paragraphs(text: str) -> list[str]:
  """The non-empty paragraphs of ``text`` (split at blank lines), each
  with its whitespace collapsed to single spaces.
  """
  out = []
  for block in re.split(r"\n\s*\n", text):
    block = " ".join(block.split())
    if block:
      out.append(block)
  return out


# -- documents to splits ----------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Document:
  name: str  # "<package>/<path>", unique.
  text: str


@dataclasses.dataclass
class Split:
  train: list[Document]
  heldout: list[Document]
  dropped: dict  # Why documents and paragraphs were dropped: counts.


def clean(documents: Iterable[Document]) -> tuple[list[Document], dict]:
  """Deduplicated documents, in the order given.

  Every paragraph of at least ``DEDUPE_CHARS`` characters that occurred
  before (in this or an earlier document) is dropped, so no such paragraph
  is in two documents; then documents under ``MIN_DOCUMENT_BYTES`` or with
  less than ``MIN_ASCII`` ASCII bytes are dropped.
  """
  seen, out = set(), []
  dropped = dict(
    repeated_paragraphs=0,
    repeated_bytes=0,
    short_documents=0,
    non_ascii_documents=0,
  )
  for doc in documents:
    kept = []
    for par in paragraphs(doc.text):
      if len(par) >= DEDUPE_CHARS:
        key = hashlib.sha256(par.encode()).digest()
        if key in seen:
          dropped["repeated_paragraphs"] += 1
          dropped["repeated_bytes"] += len(par.encode())
          continue
        seen.add(key)
      kept.append(par)
    data = "\n\n".join(kept).encode()
    if len(data) < MIN_DOCUMENT_BYTES:
      dropped["short_documents"] += 1
      continue
    if sum(b < 128 for b in data) < MIN_ASCII * len(data):
      dropped["non_ascii_documents"] += 1
      continue
    out.append(Document(doc.name, data.decode()))
  return out, dropped


def _rank(name: str) -> bytes:
  return hashlib.sha256(name.encode()).digest()


def split(
  documents: Iterable[Document], heldout_bytes: int = HELDOUT_BYTES
) -> Split:
  """Cleans ``documents`` (:func:`clean`) and holds out whole documents.

  The held-out documents are those first by the sha256 of their names
  until they hold ``heldout_bytes``: a choice that depends on no order and
  on no other document, spread over the sources as the text is. The rest,
  in the order given, is the training split.
  """
  docs, dropped = clean(documents)
  chosen, size = set(), 0
  for doc in sorted(docs, key=lambda d: _rank(d.name)):
    if size >= heldout_bytes:
      break
    chosen.add(doc.name)
    size += len(doc.text.encode()) + len(SEPARATOR)
  return Split(
    train=[d for d in docs if d.name not in chosen],
    heldout=[d for d in docs if d.name in chosen],
    dropped=dropped,
  )


def joined(documents: list[Document]) -> bytes:
  """A split's text: its documents joined by ``SEPARATOR``, UTF-8."""
  return SEPARATOR.join(d.text for d in documents).encode()


# -- the build --------------------------------------------------------------


def source_documents(source: Source, deb: str) -> Iterator[Document]:
  """The documents (HTML pages as text) of ``source``'s package file."""
  exclude = [re.compile(e) for e in source.exclude]
  pages = []
  for path, data in deb_members(deb):
    if not path.startswith(source.root) or not path.endswith(".html"):
      continue
    page = path[len(source.root) :]
    if page.startswith("_") or any(e.search(page) for e in exclude):
      continue
    pages.append((page, data))
  for page, data in sorted(pages):
    text = html_text(data.decode("utf-8", errors="replace"))
    yield Document(f"{source.package}/{page}", text)


def _sha256_file(path: str) -> str:
  h = hashlib.sha256()
  with open(path, "rb") as f:
    for chunk in iter(lambda: f.read(1 << 20), b""):
      h.update(chunk)
  return h.hexdigest()


def download(packages: list[str], folder: str) -> dict[str, str]:
  """``apt-get download`` each package into ``folder``: name -> .deb path."""
  subprocess.run(["apt-get", "download", *packages], cwd=folder, check=True)
  return find_debs(packages, folder)


def find_debs(packages: list[str], folder: str) -> dict[str, str]:
  out = {}
  for package in packages:
    found = sorted(f for f in os.listdir(folder) if f.startswith(package + "_"))
    if not found:
      raise SystemExit(
        f"corpus: no {package}_*.deb in {folder}; run without --debs to "
        "download it (apt-get download)."
      )
    out[package] = os.path.join(folder, found[-1])
  return out


def build(out: str, debs: str | None, heldout_bytes: int) -> dict:
  """Builds the corpus into ``out``; returns its manifest."""
  start = time.time()
  packages = [s.package for s in SOURCES]
  with tempfile.TemporaryDirectory() as tmp:
    paths = find_debs(packages, debs) if debs else download(packages, tmp)
    sources, documents = [], []
    for source in SOURCES:
      deb = paths[source.package]
      version = deb_version(deb)
      if version != source.version:
        print(
          f"corpus: WARNING: {source.package} is {version}, the recorded "
          f"corpus was built from {source.version}: the text (and its "
          "sha256) may differ from the recorded one.",
          file=sys.stderr,
        )
      docs = list(source_documents(source, deb))
      documents += docs
      sources.append(
        dict(
          package=source.package,
          version=version,
          licence=source.licence,
          deb=os.path.basename(deb),
          deb_sha256=_sha256_file(deb),
          pages=len(docs),
          page_text_bytes=sum(len(d.text.encode()) for d in docs),
        )
      )
      print(
        f"corpus: {source.package} {version}: {len(docs)} pages, "
        f"{sources[-1]['page_text_bytes']:,} bytes of text",
        file=sys.stderr,
      )
  result = split(documents, heldout_bytes)
  os.makedirs(out, exist_ok=True)
  splits = {}
  for name, docs in (("train", result.train), ("heldout", result.heldout)):
    data = joined(docs)
    path = os.path.join(out, f"{name}.txt.xz")
    with lzma.open(path, "wb", preset=XZ_PRESET) as f:
      f.write(data)
    splits[name] = dict(
      file=os.path.basename(path),
      bytes=len(data),
      sha256=hashlib.sha256(data).hexdigest(),
      xz_bytes=os.path.getsize(path),
      documents=len(docs),
      ascii_fraction=round(sum(b < 128 for b in data) / len(data), 5),
    )
    print(
      f"corpus: {name}: {len(docs)} documents, {len(data):,} bytes, "
      f"{splits[name]['xz_bytes']:,} compressed",
      file=sys.stderr,
    )
  manifest = dict(
    format=1,
    built_with="python -m immgrad.experiments.corpus build",
    sources=sources,
    cleaning=dict(
      html="role=main content (else body) without nav, sidebars, headers, "
      "footers, scripts, styles and <pre> blocks",
      dedupe_chars=DEDUPE_CHARS,
      min_document_bytes=MIN_DOCUMENT_BYTES,
      min_ascii=MIN_ASCII,
      separator=SEPARATOR,
      dropped=result.dropped,
    ),
    splits=splits,
    heldout_documents=[d.name for d in result.heldout],
    build_seconds=round(time.time() - start, 1),
  )
  with open(os.path.join(out, "manifest.json"), "w") as f:
    json.dump(manifest, f, indent=1)
    f.write("\n")
  return manifest


def main(argv=None):
  p = argparse.ArgumentParser(
    prog="python -m immgrad.experiments.corpus",
    description="Build the lm task's text corpus from Debian's "
    "documentation packages (see the module's docstring).",
  )
  sub = p.add_subparsers(dest="command", required=True)
  b = sub.add_parser("build", help="download, clean, split, compress")
  b.add_argument("--out", required=True, help="folder to write")
  b.add_argument(
    "--debs",
    default=None,
    help="read the packages' .deb files from this folder instead of "
    "downloading them",
  )
  b.add_argument("--heldout-bytes", type=int, default=HELDOUT_BYTES)
  args = p.parse_args(argv)
  manifest = build(args.out, args.debs, args.heldout_bytes)
  print(json.dumps(manifest["splits"], indent=1))
  return 0


if __name__ == "__main__":
  sys.exit(main())
