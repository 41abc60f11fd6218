"""``kvpass::`` custom ops and the graph pass that rewrites attention sites into them.

Importing :mod:`kvpass.lowering.ops` registers the ops; :func:`kvpass.kvpass` does that lazily.
:mod:`kvpass.lowering.dispatch` (a kernel's device path, called by the runtime) sits below the rest of
this folder, with the kernels: docs/architecture.md, "Layers"."""
