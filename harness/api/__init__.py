"""The harness from Python (docs/python.md): `harness.launch` (launching.py) and the runs it makes (handle.py), the
verbs' own core; a function launch's two ends (function.py, the caller's; rank.py, what each rank runs). The names are
harness's own (harness/__init__.py); this package imports nothing, so that a rank's start pays for none of it."""
