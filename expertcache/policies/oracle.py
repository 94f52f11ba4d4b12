"""Fast verbs of a next-use oracle: the policy keeps, per key, a number read from the
future (`aux`, one entry per distinct-key access of the replay) and evicts the lowest
score = -that number. `sim.belady` feeds it the call of each key's next use. Oracles are
never registered as deployable policies; these verbs exist so the compiled replay can
run them.

    key[NEXT] = aux[access] on every use;  score = -key[NEXT]
"""

from numba import njit

NEXT = 0


@njit(cache=True, inline="always")
def touch(kst, aux, key, access):
    kst[NEXT, key] = aux[access]


@njit(cache=True, inline="always")
def score(kst, key):
    return -kst[NEXT, key]
