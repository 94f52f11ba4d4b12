"""expertcache: a GPU pool of expert slots for mixture-of-experts decoding.

Routed expert ids flow in per MoE layer call; `ensure` maps them to slot ids, picks
victims for the missing ones with a pluggable eviction policy, and plans their copies.
`HostCache` is the exact host reference of that contract; `replay.replay_calls` replays
whole traces through the same contract at compiled speed.
"""

from expertcache.errors import EnsureError, FormatError, PolicyError
from expertcache.geometry import CPU_SLOT, NO_KEY, NO_SLOT, CacheGeometry
from expertcache.host import EnsureResult, HostCache
from expertcache.policies import get_policy, policy_names
from expertcache.split import ChannelCosts, MissSplit

__all__ = [
    "CPU_SLOT",
    "NO_KEY",
    "NO_SLOT",
    "CacheGeometry",
    "ChannelCosts",
    "EnsureError",
    "EnsureResult",
    "FormatError",
    "HostCache",
    "MissSplit",
    "PolicyError",
    "get_policy",
    "policy_names",
]
__version__ = "0.1.0"
