"""W12: lossless 12-bit storage of BF16 weights, and the kernels that use it.

``import w12`` registers the ops and never initialises CUDA; compiled kernels load on first use.
"""

from . import hf as _hf  # noqa: F401  (registers the 'w12' method with Transformers once it is imported)
from .codec import linear, pack, unpack, unpack_8bit
from .format import FORMAT_VERSION, convert_layout, get_layout, register_layout, registered_layouts
from .head import CertifiedHead as CertifiedHead
from .nn import W12Linear as W12Linear
from .patch import patch as patch
from .patch import unpatch as unpatch
from .weight import W12FormatError, W12Weight

__version__ = "0.1.0"

__all__ = [
    "FORMAT_VERSION",
    "W12FormatError",
    "W12Weight",
    "convert_layout",
    "get_layout",
    "linear",
    "pack",
    "register_layout",
    "registered_layouts",
    "unpack",
    "unpack_8bit",
]
