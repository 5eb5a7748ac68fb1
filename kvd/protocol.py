"""The wire protocol's public name: ``from kvd import protocol`` (docs/protocol.md).

A sans-IO codec (bytes in, messages out, with limits): the code lives in :mod:`kvd.wire.protocol`, its messages
in :mod:`kvd.wire.messages`, its constants and field checks in :mod:`kvd.wire.schema`.
"""

from kvd.wire.protocol import *  # noqa: F403
