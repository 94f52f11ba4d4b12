"""The policy registry: one name per policy; `--moe-cache-policy` offers its keys.

    >>> policy_names()
    ['lfuda', 'lru', 'markov', 'rule']
"""

from __future__ import annotations

from expertcache.errors import PolicyError
from expertcache.geometry import CacheGeometry
from expertcache.policies.base import Policy, PolicyInfo
from expertcache.policies.lfuda import LFUDA
from expertcache.policies.lru import LRU
from expertcache.policies.markov import Markov
from expertcache.policies.rule import Rule

REGISTRY: dict[str, PolicyInfo] = {}


def register(info: PolicyInfo) -> None:
    """Add a policy; names are lowercase and unique."""
    if info.name != info.name.lower() or info.name in REGISTRY:
        raise PolicyError(f"policy name {info.name!r} must be lowercase and not yet registered")
    REGISTRY[info.name] = info


register(PolicyInfo("lru", LRU, "least recently used (score = call of last use)"))
register(PolicyInfo("rule", Rule, "cycle-aware recency + decayed log frequency + near-miss refresh"))
register(PolicyInfo("lfuda", LFUDA, "least frequently used with dynamic aging"))
register(PolicyInfo("markov", Markov, "per-layer routing transitions predict each expert's next use"))


def policy_names(include_oracles: bool = False) -> list[str]:
    """Registered names, sorted; oracles (simulator only) only when asked for."""
    return sorted(n for n, i in REGISTRY.items() if include_oracles or not i.oracle)


def get_policy(name: str, geometry: CacheGeometry, **constants) -> Policy:
    """Build the policy `name` for `geometry`; `constants` override its defaults.

    Raises PolicyError naming the choices for an unknown name (`--moe-cache-policy`).
    """
    info = REGISTRY.get(name)
    if info is None:
        raise PolicyError(
            f"unknown policy {name!r} (--moe-cache-policy): choose one of "
            + ", ".join(policy_names(include_oracles=True))
        )
    try:
        return info.factory(geometry, **constants)
    except TypeError as exc:
        raise PolicyError(f"bad constants for policy {name!r}: {exc}") from None


__all__ = ["REGISTRY", "Policy", "PolicyInfo", "get_policy", "policy_names", "register"]
