"""Sampling randomness drawn from a CSPRNG, and exact samplers built on it.

Amplification by subsampling holds only if the sample is random *and secret* (privacy-accounting
note, section 6). A pseudo-random generator merely *seeded* from a CSPRNG is not enough: its state
is a secret that can be saved, copied into a checkpoint, or (for numpy's PCG64) stepped backwards to
recover every past sample. So the sampler draws every random bit from a ``RandomSource``:

* ``SystemRandomSource``: the operating system's CSPRNG (``os.urandom``), with no state of its own;
  this is what a private run uses.
* ``InsecureSeededSource``: a deterministic keystream (SHAKE-256 over seed, stream and a counter)
  for tests and for runs labelled insecure. Anyone who knows the seed knows every sample.

On top of a source:

* ``randbelow`` (a source method) is exactly uniform on ``{0, ..., n - 1}`` (rejection sampling);
* ``sample_without_replacement`` is exactly uniform over ordered ``k``-subsets (partial
  Fisher-Yates driven by ``randbelow``);
* ``bernoulli`` includes each item with probability ``floor(p * 2**64) / 2**64`` exactly
  (``bernoulli_probability``). This is at most ``p``, so the rate the accountant is given is an
  upper bound on the rate that runs; the PLD of the subsampled Gaussian is monotone in the rate
  (more sampling, more loss), so the accounted epsilon errs on the safe side. The shortfall is below
  ``2**-64`` and is zero for every ``p >= 2**-11``.

Nothing here touches numpy's, torch's or Python's global generators.
"""

from __future__ import annotations

import hashlib
import math
import os
from collections.abc import Callable
from fractions import Fraction
from typing import Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt

_TWO_64 = 1 << 64
_KEYSTREAM_DOMAIN = b"fedmeta.accounting.InsecureSeededSource.v1\x00"


@runtime_checkable
class RandomSource(Protocol):
    """Where a sampler's random bits come from.

    ``secure`` is True only for a source whose output nobody can predict or replay (the OS CSPRNG).
    """

    @property
    def secure(self) -> bool:
        """Whether the output is secret (drawn from a CSPRNG, not derived from a known seed)."""
        ...

    def random_bytes(self, n: int) -> bytes:
        """Return ``n`` uniformly random bytes."""
        ...

    def randbelow(self, n: int) -> int:
        """Return an integer uniform on ``{0, ..., n - 1}``, exactly (``n >= 1``)."""
        ...


def _check_count(name: str, value: object, *, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}; got {value!r}")
    return int(value)


def _randbelow(random_bytes: Callable[[int], bytes], n: object) -> int:
    """Exactly uniform integer in ``[0, n)`` by rejection sampling.

    Draw ``bit_length(n - 1)`` bits and retry while the value is ``>= n`` (fewer than two draws on
    average). Unlike reduction modulo ``n``, this has no bias.
    """
    bound = _check_count("n", n, minimum=1)
    if bound == 1:
        return 0
    bits = (bound - 1).bit_length()
    mask = (1 << bits) - 1
    nbytes = (bits + 7) // 8
    while True:
        value = int.from_bytes(random_bytes(nbytes), "little") & mask
        if value < bound:
            return value


class SystemRandomSource:
    """The operating system's CSPRNG (``os.urandom``): the source for private runs.

    It holds no state: there is nothing to save in a checkpoint, and nothing from which past or
    future samples could be reconstructed. Two instances are indistinguishable.
    """

    __slots__ = ()

    @property
    def secure(self) -> bool:
        """Always True: every byte comes from the OS CSPRNG."""
        return True

    def random_bytes(self, n: int) -> bytes:
        """Return ``n`` bytes from ``os.urandom``."""
        return os.urandom(_check_count("n", n, minimum=0))

    def randbelow(self, n: int) -> int:
        """Exactly uniform on ``{0, ..., n - 1}`` (rejection sampling over ``os.urandom``)."""
        return _randbelow(os.urandom, n)

    def __repr__(self) -> str:
        return "SystemRandomSource()"


class InsecureSeededSource:
    """INSECURE, TESTS ONLY: a deterministic keystream from ``(seed, stream)``.

    Call ``i`` returns ``SHAKE-256(key || i)`` truncated to the requested length, with
    ``key = SHA-256(domain || seed || stream)``: the output is a fixed function of the seed, the
    stream and the sequence of requests, so a test (or a run labelled insecure) is reproducible.
    Whoever knows the seed knows every sample, which voids amplification by subsampling. A run that
    resumes re-creates the source per round, ``InsecureSeededSource(seed, stream=round_index)``,
    instead of saving any state.
    """

    def __init__(self, seed: int, stream: int | str = 0) -> None:
        """Create the keystream for ``seed`` (an integer >= 0) and ``stream`` (int >= 0 or str)."""
        seed = _check_count("seed", seed, minimum=0)
        if isinstance(stream, str):
            stream_tag, stream_bytes = b"s", stream.encode("utf-8")
        else:
            stream = _check_count("stream", stream, minimum=0)
            stream_tag, stream_bytes = b"i", _int_bytes(stream)
        self._seed = seed
        self._stream: int | str = stream
        seed_bytes = _int_bytes(seed)
        # Length-prefixed fields: (seed, stream) pairs can never collide by concatenation.
        material = b"".join(
            (
                _KEYSTREAM_DOMAIN,
                len(seed_bytes).to_bytes(8, "big"),
                seed_bytes,
                stream_tag,
                len(stream_bytes).to_bytes(8, "big"),
                stream_bytes,
            )
        )
        self._key = hashlib.sha256(material).digest()
        self._counter = 0

    @property
    def secure(self) -> bool:
        """Always False: the output is a function of a known seed."""
        return False

    def random_bytes(self, n: int) -> bytes:
        """Return the next ``n`` keystream bytes (deterministic)."""
        count = _check_count("n", n, minimum=0)
        block = hashlib.shake_256(self._key + self._counter.to_bytes(8, "big")).digest(count)
        self._counter += 1
        return block

    def randbelow(self, n: int) -> int:
        """Exactly uniform on ``{0, ..., n - 1}`` given uniform keystream bytes."""
        return _randbelow(self.random_bytes, n)

    def __repr__(self) -> str:
        return (
            f"InsecureSeededSource(seed={self._seed}, stream={self._stream!r}) "
            "[INSECURE: tests only, the samples are public]"
        )


def _int_bytes(value: int) -> bytes:
    return value.to_bytes(max(1, (value.bit_length() + 7) // 8), "big")


def check_source(source: object) -> RandomSource:
    """The source, if it is a ``RandomSource``; else a ValueError naming the two to use."""
    if not isinstance(source, RandomSource):
        raise ValueError(
            "source must be a RandomSource (SystemRandomSource() for private runs, "
            f"InsecureSeededSource(seed) for tests); got {source!r}"
        )
    return source


def _bernoulli_threshold(p: object) -> int:
    if isinstance(p, bool) or not isinstance(p, int | float | np.floating):
        raise ValueError(f"p must be a number in [0, 1]; got {p!r}")
    value = float(p)
    if not (math.isfinite(value) and 0.0 <= value <= 1.0):
        raise ValueError(f"p must be a number in [0, 1]; got {p!r}")
    # ldexp is exact (a power-of-two scaling), and floor rounds down: threshold / 2**64 <= p.
    return math.floor(math.ldexp(value, 64))


def bernoulli_probability(p: float) -> Fraction:
    """The exact inclusion probability of ``bernoulli(source, n, p)``: ``floor(p * 2**64) / 2**64``.

    Never above ``p`` (the safe side for the accountant, which is given ``p``); equal to ``p`` for
    every float ``p >= 2**-11``.
    """
    return Fraction(_bernoulli_threshold(p), _TWO_64)


def bernoulli(source: RandomSource, n: int, p: float) -> npt.NDArray[np.bool_]:
    """``n`` independent draws, each True with probability ``bernoulli_probability(p)`` exactly.

    Each draw compares 64 uniform bits ``u`` with ``t = floor(p * 2**64)``, and
    ``P(u < t) = t / 2**64``.
    """
    return bernoulli_unchecked(check_source(source), _check_count("n", n, minimum=0), p)


#: Most 64-bit words drawn in one request: a draw over millions of tasks streams in chunks (8 MiB),
#: so its memory is one flag per task rather than nine bytes (issue 21: 10 million tasks per
#: participant died with MemoryError here). Smaller draws are one request, as before.
BERNOULLI_CHUNK = 1 << 20


def bernoulli_unchecked(source: RandomSource, count: int, p: float) -> npt.NDArray[np.bool_]:
    """``bernoulli`` for a source and count already checked (the sampler's inner loop)."""
    threshold = _bernoulli_threshold(p)
    if threshold >= _TWO_64:  # p == 1: every draw is included (t / 2**64 == 1)
        return np.ones(count, dtype=np.bool_)
    out = np.empty(count, dtype=np.bool_)
    for start in range(0, count, BERNOULLI_CHUNK):
        size = min(BERNOULLI_CHUNK, count - start)
        words = np.frombuffer(source.random_bytes(8 * size), dtype="<u8")
        np.less(words, np.uint64(threshold), out=out[start : start + size])
    return out


def sample_without_replacement(source: RandomSource, population: int, k: int) -> list[int]:
    """``k`` distinct integers from ``range(population)``, every ordered k-subset equally likely.

    Partial Fisher-Yates: step ``i`` swaps position ``i`` with a uniform position in
    ``[i, population)``. With an exactly uniform ``randbelow`` the result is exactly uniform. Only
    the swapped positions are stored, so the cost is O(k) even for a huge population.
    """
    src = check_source(source)
    size = _check_count("population", population, minimum=0)
    count = _check_count("k", k, minimum=0)
    if count > size:
        raise ValueError(f"k must be <= population ({size}); got {count}")
    return sample_without_replacement_unchecked(src, size, count)


def sample_without_replacement_unchecked(source: RandomSource, size: int, count: int) -> list[int]:
    """``sample_without_replacement`` for arguments already checked (the sampler's inner loop)."""
    swapped: dict[int, int] = {}
    out: list[int] = []
    for i in range(count):
        j = i + source.randbelow(size - i)
        out.append(swapped.get(j, j))
        swapped[j] = swapped.get(i, i)
    return out
