"""Griffe extension: read immgrad's docstrings as the house style writes them.

* ``Example:`` is read as ``Examples:``: griffe's Google parser knows only
  the plural, and would render the ``>>>`` lines as text.
* Sphinx roles (``:func:`x```, ``:class:`x```) become code (`` `x` ``):
  Markdown would show the role's name.

Used by mkdocstrings (mkdocs.yml).
"""

import re

import griffe

_EXAMPLE = re.compile(r"^Example:$", re.M)
_ROLE = re.compile(r":(?:func|class|data|meth|mod|attr):`")


class HouseStyle(griffe.Extension):
  def on_object(self, *, obj, **kwargs):
    del kwargs
    if obj.docstring is not None:
      text = _EXAMPLE.sub("Examples:", obj.docstring.value)
      obj.docstring.value = _ROLE.sub("`", text)
