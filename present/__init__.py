"""Presentation of tuning results, shared by ``autotune report`` and the service's pages.

Below both of its users: imports ``kernel`` (the plot axes come from each kernel's contract),
``storage`` and the libraries it draws with, never ``api`` or ``autotune``. The HTML templates
are package data (``present/templates``), loaded through the package, not by path.

- :mod:`present.text`: error text as trials store and pages show it (no dependencies).
- :mod:`present.studies`: a tuning study read from Optuna as plain data.
- :mod:`present.plots`: the four figures of a study, as PNG data URIs.
- :mod:`present.views`: the Jinja2 templates and what they show per stored winner.
"""
