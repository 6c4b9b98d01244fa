"""flash-autotune: the tuner (search, measurement, CLI) composing ``kernel`` and ``storage``."""

__version__ = "0.1.0"
