"""Gaussian noise for the sum of clipped per-task gradients; the mechanism returns its event.

A round releases ``sum_i clip_C(g_i) + N(0, (z C)^2 I)`` (DP-MAML Algorithm 1; Abadi et al. 2016),
one draw per coordinate of the flat vector. How the draw is made is part of the guarantee:

* **Randomness from a CSPRNG itself.** Each :class:`NoiseSource` holds AES-128 in counter mode
  (``randomgen.AESCounter``, AES-NI where the CPU has it), keyed with 128 bits from the operating
  system's CSPRNG when the source is created. The keystream *is* the randomness: no PRNG is seeded
  from it (torch's Mersenne Twister keeps 32 bits of a seed, and a searched seed lets anyone
  subtract the noise). The keys live in memory only: never logged, checkpointed, or derivable from
  anything fedmeta writes. A resumed run draws fresh keys.
* **A documented transform.** The keystream is turned into standard normals by numpy's
  ``Generator.standard_normal`` (the ziggurat method of Marsaglia and Tsang 2000, as implemented in
  numpy >= 1.17), two independent streams filling the two halves of the vector in parallel; a
  draw with ``|Z| >= 4.5`` is redrawn from the exact tail (``_exact_tails``).
* **Floating-point attacks (Mironov 2012; Jin et al. 2022; Haney et al. 2022).** They exploit that
  the *exact* floating-point value of ``x + noise`` reveals which inputs could have produced it.
  fedmeta releases the noisy sum rounded to a power-of-two grid ``gamma = 2^(floor(log2 sigma) -
  10)``, i.e. between sigma/2048 and sigma/1024: a post-processing of the ideal Gaussian mechanism,
  whose accounting is therefore unchanged, and a value whose low-order bits carry no information.
  What remains is the difference between the implemented and the ideal probability of each grid
  cell, which comes only from (a) the floating-point error of the addition, made in cells (see
  ``_on_grid``: under 2^-37 of a cell whatever ``|S|``) and (b) the sampler's lattice (numpy's
  ziggurat, whose coarse far tail is redrawn exactly: ``_exact_tails``). :func:`float_residual`
  bounds it (a factor ``1 +- 2^-34`` on every cell's probability) and folds it into the reported
  epsilon and delta (docs/privacy.md). The released
  value also reaches participants only through the optimizer step and the float32 model, a
  further post-processing.
* **Adaptive clipping.** :func:`noised_release` also releases the centred count of the lot's clip
  bits with ``N(0, s_b^2)`` and lowers the gradient's multiplier to ``z_grad = (z^-2 -
  (2 s_b)^-2)^(-1/2)`` (accounting/fedmeta/accounting/adaptive.py), so the two releases together are
  the one Gaussian
  round at ``z`` that the event records. The count is drawn after the gradient, from the same
  source, and rounded to its own grid.
* **Test mode.** :meth:`NoiseSource.insecure_for_tests` derives the keys from a seed, so runs are
  reproducible; it is labelled ``secure=False`` in every output and never spends from a ledger
  that a secure run uses (server/fedmeta/server/run.py).
"""

from __future__ import annotations

import hashlib
import math
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import randomgen
import torch
from torch import Tensor

from fedmeta.accounting import GaussianRound, gradient_noise_multiplier

#: The release grid is 2^-GRID_BITS of the noise standard deviation (to within a factor 2).
GRID_BITS = 10
#: Independent keystreams filled in parallel (numpy releases the GIL while it fills an array).
STREAMS = 2
_PARALLEL_FROM = 1 << 16  # below this a thread costs more than it saves


def _aes_generator(key: bytes) -> np.random.Generator:
    if len(key) != 16:
        raise ValueError(f"key must be 16 bytes (AES-128); got {len(key)}")
    return np.random.Generator(randomgen.AESCounter(key=int.from_bytes(key, "little")))


class NoiseSource:
    """Standard normal draws from AES-128-CTR keystreams; ``secure`` says whose keys they are."""

    def __init__(self, keys: list[bytes], *, secure: bool) -> None:
        """Use :meth:`create` (secure) or :meth:`insecure_for_tests`."""
        if not keys:
            raise ValueError("keys must hold at least one 16-byte key; got none")
        self._generators = [_aes_generator(k) for k in keys]
        self.secure = secure

    @classmethod
    def create(cls, streams: int = STREAMS) -> NoiseSource:
        """A source keyed from the operating system's CSPRNG: the noise is secret."""
        return cls([os.urandom(16) for _ in range(streams)], secure=True)

    @classmethod
    def insecure_for_tests(cls, seed: int, stream: int = 0, streams: int = STREAMS) -> NoiseSource:
        """TESTS ONLY: keys derived from ``(seed, stream)``; anyone with the seed has the noise."""
        keys = [
            hashlib.sha256(f"fedmeta-insecure-noise:{seed}:{stream}:{i}".encode()).digest()[:16]
            for i in range(streams)
        ]
        return cls(keys, secure=False)

    def __repr__(self) -> str:
        kind = "secure" if self.secure else "INSECURE test"
        return f"NoiseSource({kind}, {len(self._generators)} AES-CTR streams)"

    def standard_normal(self, n: int) -> np.ndarray:
        """``n`` independent N(0, 1) draws (float64)."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"n must be an integer >= 0; got {n!r}")
        out = np.empty(n, dtype=np.float64)
        parts = np.array_split(out, len(self._generators))
        if n < _PARALLEL_FROM:
            for gen, part in zip(self._generators, parts, strict=True):
                gen.standard_normal(out=part)
            _exact_tails(out, self._generators[0])
            return out
        threads = [
            threading.Thread(target=gen.standard_normal, kwargs={"out": part})
            for gen, part in zip(self._generators, parts, strict=True)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        _exact_tails(out, self._generators[0])
        return out


#: From this ``|Z|`` on, a draw is replaced by an exact draw from the same tail. numpy's ziggurat
#: draws its tail as ``-log1p(-U) / r`` of a 53-bit ``U``, whose lattice is finer than a release
#: cell's ``2^-38`` only up to ``|Z|`` about 4.9 (at 13 its spacing is 0.02, 40 cells); 4.5 is
#: below that. About 7 in a million draws are replaced.
TAIL_FROM = 4.5


def _exact_tails(out: np.ndarray, generator: np.random.Generator) -> None:
    """Replace each ``|Z| >= TAIL_FROM`` by ``sign(Z) |N|``, ``|N|`` given ``|N| >= TAIL_FROM``.

    The sign and the event ``|Z| >= TAIL_FROM`` are the ziggurat's (its mass of that event is the
    ideal one to a relative ``2^-38``); the magnitude is Marsaglia's (1964) exact tail algorithm,
    ``x = sqrt(a^2 - 2 log V1)`` accepted when ``V2 x <= a``, with ``V1`` of full relative
    precision (:func:`_fine_uniform`), so that its lattice stays under ``2^-52 / x`` in ``x``.
    """
    rare = np.flatnonzero(np.abs(out) >= TAIL_FROM)
    if not rare.size:
        return
    raw = generator.bit_generator.random_raw
    for i in rare:
        out[i] = math.copysign(_tail(lambda: int(raw())), float(out[i]))


def _tail(raw: Callable[[], int]) -> float:
    a = TAIL_FROM
    while True:
        x = math.sqrt(a * a - 2.0 * math.log(_fine_uniform(raw)))
        if _fine_uniform(raw) * x <= a:
            return x


def _fine_uniform(raw: Callable[[], int]) -> float:
    """Uniform on (0, 1) with 52 significant bits at every scale (not a 2^-53 lattice).

    The binade ``[2^-(j+1), 2^-j)`` is chosen with probability ``2^-(j+1)`` (``j``: leading zero
    bits of a random bit string, 64 per word), the significand from 52 more random bits.
    """
    zeros = 0
    word = raw()
    while word == 0 and zeros < 1000:  # a zero word has probability 2^-64
        zeros += 64
        word = raw()
    zeros += 64 - word.bit_length()
    significand = 1.0 + (raw() >> 12) * 2.0**-52
    return math.ldexp(significand, -(zeros + 1))


def release_grid(std: float) -> float:
    """The power-of-two grid the noisy sum is rounded to: ``2^(floor(log2 std) - GRID_BITS)``."""
    if not (math.isfinite(std) and std > 0):
        raise ValueError(f"std must be a finite number > 0; got {std}")
    return math.ldexp(1.0, math.floor(math.log2(std)) - GRID_BITS)


@dataclass(frozen=True)
class NoisedSum:
    """The released noisy sum, the accounting event of the mechanism that produced it, its scale."""

    value: Tensor  # float64, on the release grid
    event: GaussianRound
    noise_std: float
    grid: float


def noised_sum(
    total: Tensor, *, clip: float, event: GaussianRound, source: NoiseSource
) -> NoisedSum:
    """Release ``total`` (a sum of vectors clipped to ``clip``) with ``N(0, (z C)^2 I)`` added.

    ``z`` is read from ``event``, so the noise drawn and the event spent cannot disagree. The caller
    records the spend in the ledger *before* calling this function.
    """
    z = float(event.noise_multiplier)
    if not (math.isfinite(clip) and clip > 0):
        raise ValueError(f"clip must be a finite number > 0; got {clip}")
    std = z * float(clip)
    exact = total.detach().to(torch.float64).cpu().numpy().reshape(-1)
    released, grid = _on_grid(exact, std, source)
    return NoisedSum(torch.from_numpy(released).reshape(total.shape), event, std, grid)


@dataclass(frozen=True)
class NoisedRelease:
    """A round's two releases under adaptive clipping and the one event that accounts for both."""

    value: Tensor  # the noisy gradient sum, float64, on its release grid
    count: float  # the noisy centred count sum_i (b_i - 1/2) + N(0, s_b^2), on its grid
    event: GaussianRound  # the total z: covers both releases (fedmeta.accounting.adaptive)
    noise_std: float  # z_grad * C
    count_std: float  # s_b
    grid: float


def _on_grid(exact: np.ndarray, std: float, source: NoiseSource) -> tuple[np.ndarray, float]:
    """``exact + N(0, std^2)`` rounded to the release grid of ``std``, and that grid.

    Computed in cells of the grid so that the one inexact addition is of two numbers under
    ``2^16`` whatever the size of ``exact``: ``exact / grid`` (exact: a power-of-two scaling) is
    split into its integer part and a fraction in (-1, 1) (``trunc``, exact), the noise in cells
    ``(std / grid) * Z`` is added to the fraction only, rounded to the nearest integer and added
    back to the integer part (exact below ``2^53``). The rounding error is then under ``2^-37`` of
    a cell, which :func:`float_residual` bounds.
    """
    grid = release_grid(std)
    cells = exact / grid
    if cells.size and not float(np.max(np.abs(cells))) < 2.0**51:
        # Only a sum over about 2^40 z tasks gets here; no configuration in range does.
        raise ValueError(f"the sum is too large for its release grid ({grid:g}); raise the noise")
    whole = np.trunc(cells)
    cells -= whole  # the fraction, exactly (Sterbenz: whole is within a factor 2 of cells, or 0)
    released = source.standard_normal(exact.size)
    released *= std / grid  # std / grid is in (2^GRID_BITS, 2^(GRID_BITS+1)]: exact scaling
    released += cells
    np.rint(released, out=released)
    released += whole
    released *= grid
    return released, grid


#: Bound on how far the implementation moves the probability of any release cell, relative to
#: the ideal rounded Gaussian: every cell's probability is within a factor ``1 +- r`` of the ideal.
#: The argument (docs/privacy.md, "Floating-point attacks"): the addition errs by under 2^-37 of a
#: cell, which moves each edge of a cell by that much and its mass by a factor under
#: ``1 + 2^-36 * 1.02`` while ``|Z| < 13`` (the density changes by at most 2% across a cell there);
#: the ziggurat's 52-bit lattice changes a cell's mass by under ``2^-37`` relative. ``2^-34`` is
#: more than the sum, rounded up: the bound errs on the safe side.
RESIDUAL_PER_COORDINATE = 2.0**-34
#: Where the per-cell factor is not claimed: ``|Z| >= 13`` (probability erfc(13 / sqrt 2)).
RESIDUAL_TAIL_Z = 13.0


def float_residual(coordinates: int, epsilon: float, delta: float) -> tuple[float, float]:
    """The (epsilon, delta) of the implemented releases, given the ideal mechanism's.

    ``coordinates`` is how many noisy values were released in all (model dimension, plus one
    count with adaptive clipping, times rounds). With ``r`` = :data:`RESIDUAL_PER_COORDINATE`,
    ``n`` = coordinates, ``B`` the transcripts with some ``|Z| >= 13`` and ``beta = 2 n P(|Z| >=
    13)`` (the implementation's and the ideal's mass of ``B`` are each at most ``beta``): for every
    set of transcripts ``E``, ``P'(E) <= (1 + r)^n P(E - B) + beta`` and ``P(E) <= (1 - r)^-n P'(E)
    + beta``, so an ideal (epsilon, delta) guarantee becomes

        epsilon' = epsilon + n * log((1 + r) / (1 - r))
        delta'   = (1 + r)^n * delta + ((1 + r)^n * e^epsilon + 1) * beta

    Both only grow: the bound errs on the safe side. ``log1p`` keeps the tiny terms exact.
    """
    if isinstance(coordinates, bool) or not isinstance(coordinates, int) or coordinates < 0:
        raise ValueError(f"coordinates must be an integer >= 0; got {coordinates!r}")
    r, n = RESIDUAL_PER_COORDINATE, coordinates
    log_up = n * math.log1p(r)
    added = log_up - n * math.log1p(-r)
    beta = 2 * n * math.erfc(RESIDUAL_TAIL_Z / math.sqrt(2))
    growth = math.exp(log_up)
    spread = growth * math.exp(epsilon) if epsilon < 700 else math.inf
    return epsilon + added, growth * delta + (spread + 1) * beta


def noised_release(
    total: Tensor,
    centred_count: float,
    *,
    clip: float,
    event: GaussianRound,
    count_noise: float,
    source: NoiseSource,
) -> NoisedRelease:
    """Release ``total`` and the centred bit count of the same lot (Andrew et al. 2021, Thm 1).

    ``total`` is a sum of vectors clipped to ``clip``; ``centred_count`` is ``sum_i (b_i - 1/2)``
    over the same tasks. The gradient gets ``N(0, (z_grad C)^2 I)`` with ``z_grad`` derived from
    ``event``'s total ``z`` and ``count_noise`` (``s_b``), the count ``N(0, s_b^2)``: the event
    accounts for both, so noise and event cannot disagree. The caller records the spend first.
    """
    if not (math.isfinite(clip) and clip > 0):
        raise ValueError(f"clip must be a finite number > 0; got {clip}")
    if not math.isfinite(centred_count):
        raise ValueError(f"centred_count must be finite; got {centred_count}")
    z_grad = gradient_noise_multiplier(float(event.noise_multiplier), float(count_noise))
    std = z_grad * float(clip)
    exact = total.detach().to(torch.float64).cpu().numpy().reshape(-1)
    value, grid = _on_grid(exact, std, source)
    count, _ = _on_grid(np.array([float(centred_count)]), float(count_noise), source)
    return NoisedRelease(
        torch.from_numpy(value).reshape(total.shape), float(count[0]), event, std,
        float(count_noise), grid,
    )  # fmt: skip
