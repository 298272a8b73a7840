"""The kernel families: one module per packed layout and the generated kernels that read it,
behind one interface (:mod:`sparsecc.kernels.base`), listed by :mod:`sparsecc.kernels.registry`."""
