"""Export of a personalized AdapEmu: a merged Hugging Face folder, ONNX with KV cache, int8.

``export`` imports ``ciders_edge`` (model assembly, the export-folder format), never the reverse:
its commands join ``ciders-edge`` through the ``ciders_edge.commands`` entry-point group.
"""

from export.api import export_model

__all__ = ["export_model"]
