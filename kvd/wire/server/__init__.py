"""ZeroMQ servers: :class:`ShardServer` (the data path around one Store) and :class:`TopologyServer` (the
coordinator's topology endpoint). Wire format: docs/protocol.md; codec: :mod:`kvd.protocol`.

One module per job: ``loop`` (the ROUTER loop both run: admission, replies, the connection guard),
``admission`` (its queues per connection and their turns), ``metrics`` (its counters), ``lane`` (a shard's bulk
lane for large requests), ``shard`` (the store's operations), ``topology`` (the coordinator's endpoint). Each
module's docstring has its part of the theory of operation.
"""

from kvd.wire.curve import CurveConfig, keygen
from kvd.wire.server.lane import BULK_NICE, BULK_THREAD_NAME
from kvd.wire.server.shard import (
    BULK_MIN_BYTES,
    COMPACT_STEP_BYTES,
    LOOPBACK_SOCKET_BUFFER_BYTES,
    PACK_REPLY_MAX_BYTES,
    ShardServer,
)
from kvd.wire.server.topology import TopologyServer
from kvd.wire.sockets import (
    COPY_THRESHOLD_BYTES,
    DEFAULT_HEARTBEAT_IVL_S,
    DEFAULT_HEARTBEAT_TIMEOUT_S,
    recv_frames,
    send_frames,
    tune_malloc,
)

# CurveConfig, keygen, tune_malloc and the frame helpers live in kvd.wire.curve and kvd.wire.sockets (re-exported)
__all__ = ["BULK_MIN_BYTES", "BULK_NICE", "BULK_THREAD_NAME", "COMPACT_STEP_BYTES", "COPY_THRESHOLD_BYTES",
           "DEFAULT_HEARTBEAT_IVL_S", "DEFAULT_HEARTBEAT_TIMEOUT_S", "LOOPBACK_SOCKET_BUFFER_BYTES",
           "PACK_REPLY_MAX_BYTES", "CurveConfig", "ShardServer", "TopologyServer", "keygen", "recv_frames",
           "send_frames", "tune_malloc"]
