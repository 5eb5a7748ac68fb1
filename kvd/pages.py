"""The page codec's public name: ``from kvd import pages``.

One sealed page of keys or values at a level, as self-describing bytes (:mod:`kvd.codec.pages`, byte layout in
docs/formats.md), and the assembly of a token range from pages as ``get(format="pages")`` returns them
(:mod:`kvd.codec.assemble`). This module only gathers those names; the code lives in :mod:`kvd.codec`.
"""

from kvd.codec.assemble import PARALLEL_MIN_BYTES, assemble, assemble_into
from kvd.codec.pages import *  # noqa: F403
from kvd.codec.pages import __all__ as _codec_all

__all__ = [*_codec_all, "PARALLEL_MIN_BYTES", "assemble", "assemble_into"]
