"""flash-autotune: the tuner (search, measurement, CLI) composing ``kernel`` and ``storage``.

``autotune.tune_model(fn, *abstract_args, ...)`` tunes a model's attention problems in one
call (:mod:`autotune.model`); it loads on first use, so ``import autotune`` stays cheap.
"""

from typing import Any

__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name == "tune_model":
        from autotune.model import tune_model

        return tune_model
    raise AttributeError(f"module 'autotune' has no attribute {name!r}")
