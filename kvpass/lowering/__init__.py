"""``kvpass::`` custom ops and the graph pass that rewrites attention sites into them.

Importing :mod:`kvpass.lowering.ops` registers the ops; :func:`kvpass.kvpass` does that lazily."""
