"""Griffe extension: read a docstring's ``Example:`` as ``Examples:``.

immgrad's docstrings title their runnable examples ``Example:`` (the house
style); griffe's Google parser knows only ``Examples:`` and would render the
``>>>`` lines as text. Used by mkdocstrings (mkdocs.yml).
"""

import re

import griffe

_EXAMPLE = re.compile(r"^Example:$", re.M)


class ExampleSections(griffe.Extension):

  def on_object(self, *, obj, **kwargs):
    del kwargs
    if obj.docstring is not None:
      obj.docstring.value = _EXAMPLE.sub("Examples:", obj.docstring.value)
