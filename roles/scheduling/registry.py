"""Every prefill policy by name: the paper's (policies.py) and the peer routers (peers.py).

Its own module so that ``policies`` and ``peers`` need not know each other:
peers build on policies, and only this registry sees both.
"""
from __future__ import annotations

from .peers import PEER_POLICIES
from .policies import POLICIES, Policy


def make_policy(name: str, **params: object) -> Policy:
    """Build a policy by name; `params` are its constructor arguments."""
    factories = {**POLICIES, **PEER_POLICIES}
    if name not in factories:
        raise ValueError(f"policy: unknown {name!r}; choose from {sorted(factories)}")
    try:
        return factories[name](**params)
    except TypeError as e:
        raise ValueError(f"policy {name!r}: bad parameters {params}: {e}") from None
