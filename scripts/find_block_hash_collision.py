"""Find two 16-token blocks whose old qkv block hash, Python's ``hash((parent, tuple(tokens)))``, is equal.

This is how the token ids in ``tests/core/test_prefix_hash.py`` were found (about a minute, ~1 GiB of memory). It
shows why the prefix cache must not key blocks by the built-in hash (vLLM advisory GHSA-rm76-4mrf-v9r8):
CPython's tuple hash (an xxHash-like mix, ``Objects/tupleobject.c``) of small ints is deterministic and
invertible in its last element, so colliding blocks of in-vocabulary token ids can be searched for with a
birthday search over two free tokens. Run: ``python scripts/find_block_hash_collision.py [--vocab 49152]``.
"""

from __future__ import annotations

import argparse

import numpy as np

M64 = (1 << 64) - 1
P1, P2, P5 = 11400714785074694791, 14029467366897019727, 2870177450012600261
P2_INV = pow(P2, -1, 1 << 64)


def _rotl(a):
    return (a << np.uint64(31)) | (a >> np.uint64(33))


def _step(acc, lane):
    """One element of CPython's 64-bit tuple hash; numpy uint64 arithmetic wraps modulo 2**64."""
    return _rotl(acc + lane * np.uint64(P2)) * np.uint64(P1)


def find(vocab: int, middle: list[int], span: int) -> tuple[list[int], list[int]] | None:
    """Blocks ``[x, y] + middle + [z]`` and ``[x', y'] + middle + [z']`` with equal tuple hashes, or None.

    The free tokens come first so that the fixed middle tokens mix the state well (free tokens next to
    the end leave a lattice structure that defeats the birthday search).
    """
    ys = np.arange(span, dtype=np.uint64)
    w = np.empty(span * span, dtype=np.uint64)
    with np.errstate(over="ignore"):
        for x in range(span):  # row x holds the state before the last token for every y
            acc = _step(_step(np.uint64(P5), np.uint64(x)), ys)
            for t in middle:
                acc = _step(acc, np.uint64(t))
            # The last token z enters as acc + z * P2: two states that differ by a small multiple of P2
            # are made equal by a pair of in-vocabulary last tokens.
            w[x * span : (x + 1) * span] = acc * np.uint64(P2_INV)
    order = np.argsort(w)
    w = w[order]
    gaps = w[1:] - w[:-1]
    for i in np.nonzero(gaps < np.uint64(vocab))[0]:
        ia, ib = divmod(int(order[i]), span), divmod(int(order[i + 1]), span)
        d = int(gaps[i])  # w_B - w_A = d, so z_A - z_B = d
        a = [ia[0], ia[1], *middle, d]
        b = [ib[0], ib[1], *middle, 0]
        if a != b and hash((None, tuple(a))) == hash((None, tuple(b))):
            return a, b
    return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--vocab", type=int, default=49152, help="token ids stay below this (SmolLM2: 49152)")
    ap.add_argument("--span", type=int, default=6000, help="values tried for each of the two free tokens")
    args = ap.parse_args()
    found = None
    for first in range(1, 20):  # a few tries at the default span usually suffice
        middle = [first, 504, 3575, 282, 4649, 314, 2, 504, 3575, 282, 4649, 314, 2]  # any 13 tokens
        found = find(args.vocab, middle, args.span)
        if found is not None:
            break
    if found is None:
        raise SystemExit("no collision found; try a larger --span")
    a, b = found
    print("A =", a)
    print("B =", b)
    print("hash((None, tuple(A))) =", hash((None, tuple(a))), "== hash((None, tuple(B))) =", hash((None, tuple(b))))


if __name__ == "__main__":
    main()
