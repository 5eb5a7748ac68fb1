"""A kvd on Ray: the control plane.

``membership`` is pure (shards, their reports, topology and level epochs; no ray). The Ray shells: ``shard``
(an actor owning one store and its server), ``coordinator`` (the actor around membership and the policy),
``deploy`` (start, find and stop a whole kvd). ``naming`` holds what all of them agree on (actor names, hosts,
CURVE settings), so the two actors never import each other.
"""
