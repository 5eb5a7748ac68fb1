"""The wire: what travels between a client and a shard, and the server that speaks it.

Pure, sans-IO (no zmq): ``protocol`` (encode and decode messages with limits; public as :mod:`kvd.protocol`),
``messages`` (one dataclass per request and reply), ``schema`` (constants, field checks, tensors on the wire),
``routing`` (rendezvous hashing of sequences to shards). The ZeroMQ shell: ``server`` (the ROUTER loops of a
shard and of the topology endpoint), ``sockets`` (socket options, frame I/O, malloc tuning), ``curve`` (CURVE
keys and the allow-list).
"""
