"""The layers of the call path between the front and the backends (see stack.py for
their order): "auto" routing, communication logging, zfp compression, debug-mode
agreement and validation; tensor fusion, the layer between logging and compression, is
its own package (mcrdl.fusion), whose settings and statistics are re-exported here.

The extensions (fusion, compression, logging) are turned on for every later call with
:func:`configure` (or ``mcrdl.configure``), or for a block of code with
:func:`extensions`; with none on, calls take exactly the path they take without them.
See docs/extensions.md.
"""

from ..fusion import FusionConfig, fusion_stats
from .comm_logger import reset as reset_log
from .comm_report import export_log, export_trace
from .comm_report import summary as log_summary
from .compression import compression_stats
from .config import CompressionConfig, ExtensionConfig, LoggingConfig
from .stack import configure, current, extensions

__all__ = ["configure", "current", "extensions", "log_summary", "export_log", "export_trace",
           "reset_log", "compression_stats", "CompressionConfig", "ExtensionConfig",
           "FusionConfig", "LoggingConfig", "fusion_stats"]
