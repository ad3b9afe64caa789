"""Backend classes and the plug-in registry (see base.py for the interface)."""

from .base import Backend, Capabilities, InitContext
from .registry import ENTRY_POINT_GROUP, register_backend

__all__ = ["Backend", "Capabilities", "InitContext", "ENTRY_POINT_GROUP", "register_backend"]
