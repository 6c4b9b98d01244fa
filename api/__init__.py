"""The lookup service: FastAPI app over ``storage``; never imports jax."""

from api.main import create_app
from api.settings import ApiSettings

__all__ = ["ApiSettings", "create_app"]
