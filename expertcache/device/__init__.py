"""The device ensure: the slot map and policy state on the GPU and the one Triton launch per MoE layer
call that drives them, bit for bit the host reference (expertcache.host).

    cache.py     DeviceCache (state tensors, the ensure call, snapshots), EnsureLaunch / EnsureTuning
    ensure.py    ensure_kernel: query, hits, victims, commit and plan in one launch
    policies.py  the per-policy scoring and touch of the kernel, one branch per PolicyKind
    victims.py   the lowest-(score, slot) selection of the kernel
    markov.py    markov's learning step, launched before its ensure
"""

from expertcache.device.cache import DeviceCache, EnsureLaunch, EnsureTuning, device_policy_names

__all__ = ["DeviceCache", "EnsureLaunch", "EnsureTuning", "device_policy_names"]
