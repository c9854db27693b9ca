"""Reading and re-running traced programs (jaxprs), in one place.

``equation``: one equation (the program a call runs, binding it again);
``slicing``: which values an input reaches, which equations an output
needs; ``interpret``: running a program's wanted outputs, or a part of it.
"""

from immgrad._src.jaxpr.equation import CALLS as CALLS
from immgrad._src.jaxpr.equation import has_program as has_program
from immgrad._src.jaxpr.equation import inner as inner
from immgrad._src.jaxpr.equation import rebind as rebind
from immgrad._src.jaxpr.interpret import evaluate as evaluate
from immgrad._src.jaxpr.interpret import subprogram as subprogram
from immgrad._src.jaxpr.slicing import label as label
from immgrad._src.jaxpr.slicing import needed as needed
from immgrad._src.jaxpr.slicing import reach as reach
from immgrad._src.jaxpr.slicing import varying as varying
