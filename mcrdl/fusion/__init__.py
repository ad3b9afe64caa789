"""Extensions on the call path: tensor fusion, zfp compression, communication logging.

Turned on for every later call with :func:`configure` (or ``mcrdl.configure``), or for
a block of code with :func:`extensions`; with none on, calls take exactly the path
they take without this package. See docs/extensions.md.
"""

from .chain import configure, current, extensions
from .comm_logger import export_log, export_trace
from .comm_logger import reset as reset_log
from .comm_logger import summary as log_summary
from .compression import compression_stats
from .config import CompressionConfig, ExtensionConfig, FusionConfig, LoggingConfig
from .tensor_fusion import fusion_stats

__all__ = ["configure", "current", "extensions", "log_summary", "export_log", "export_trace",
           "reset_log", "compression_stats", "CompressionConfig", "ExtensionConfig",
           "FusionConfig", "LoggingConfig", "fusion_stats"]
