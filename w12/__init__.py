"""W12: lossless 12-bit storage of BF16 weights, and the kernels that use it.

``import w12`` registers the ops and never initialises CUDA; compiled kernels load on first use.
"""

from . import hf as _hf  # noqa: F401  (registers the 'w12' method with Transformers once it is imported)
from .codec import linear, pack, unpack, unpack_8bit
from .format import FORMAT_VERSION, convert_layout, get_layout, register_layout, registered_layouts
from .fuse import fuse_projections, unfuse_projections
from .head import CertifiedHead
from .nn import W12Linear
from .patch import certified_argmax, patch, unpatch
from .weight import W12FormatError, W12Weight

__version__ = "0.1.0"

__all__ = [
    "CertifiedHead",
    "FORMAT_VERSION",
    "W12FormatError",
    "W12Linear",
    "W12Weight",
    "certified_argmax",
    "convert_layout",
    "fuse_projections",
    "get_layout",
    "linear",
    "pack",
    "patch",
    "register_layout",
    "registered_layouts",
    "unpack",
    "unfuse_projections",
    "unpack_8bit",
    "unpatch",
]
