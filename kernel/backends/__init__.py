"""The attention backends, one module (or folder) each, behind :mod:`kernel.contract`."""
