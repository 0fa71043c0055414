import os
import sys

# `python -m` puts the working folder first on sys.path (unless PYTHONSAFEPATH is set): a yaml.py
# there would be imported in place of the library. This package is already found.
if sys.path and sys.path[0] in ("", os.getcwd()):
    del sys.path[0]

from scale_llm.cli import entry  # noqa: E402

sys.exit(entry())
