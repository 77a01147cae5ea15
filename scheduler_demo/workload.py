"""A seeded synthetic workload: Poisson arrivals, random prompt and output lengths.

Lengths are drawn from a :class:`LengthDist`, written on the command line as
``KIND:ARGS``:

* ``const:N``: always ``N``;
* ``uniform:LO:HI``: an integer uniform on ``LO..HI`` (both included);
* ``exp:MEAN``: exponential with mean ``MEAN``, rounded up (a geometric-like
  tail, typical of output lengths that stop at EOS);
* ``lognormal:MEDIAN:SIGMA``: log-normal with that median and shape.

The parameters must be finite numbers. Every draw is at least 1 and at most
``MAX_LENGTH`` (a log-normal draw is capped in log space, so a huge sigma
cannot overflow), and a request never needs more than
``max_total_len`` table columns: the prompt is cut first to leave room for one
output token, then the output to fit.

A fraction ``abort_rate`` of the requests is aborted by its client, drawn
from a second seeded stream (so the lengths and arrivals do not depend on
it): half while the prompt's KV is still being transferred (at a fraction
``abort_at`` of the transfer), half while decoding (after ``abort_at`` of
the output was generated).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

__all__ = ["MAX_LENGTH", "LengthDist", "RequestSpec", "WorkloadConfig", "generate"]

_KINDS = {"const": 1, "uniform": 2, "exp": 1, "lognormal": 2}
#: The most a draw may be, whatever the distribution: far past any table.
MAX_LENGTH = 10**9


@dataclass(frozen=True)
class LengthDist:
    """A distribution of positive integer lengths (see the module docstring)."""

    kind: str
    a: float
    b: float = 0.0

    @classmethod
    def parse(cls, spec: str) -> LengthDist:
        """Parse ``KIND:ARGS``, e.g. ``uniform:32:256``; raise ValueError if bad."""
        kind, _, rest = spec.strip().partition(":")
        kind = kind.lower()
        if kind not in _KINDS:
            raise ValueError(
                f"unknown length distribution {kind!r} in {spec!r}; use one of {sorted(_KINDS)}"
            )
        try:
            args = [float(x) for x in rest.split(":")] if rest else []
        except ValueError:
            raise ValueError(f"bad numbers in length distribution {spec!r}") from None
        if len(args) != _KINDS[kind]:
            raise ValueError(f"{kind} takes {_KINDS[kind]} argument(s), got {spec!r}")
        dist = cls(kind, args[0], args[1] if len(args) > 1 else 0.0)
        dist._validate(spec)
        return dist

    def _validate(self, spec: str) -> None:
        if not (math.isfinite(self.a) and math.isfinite(self.b)):
            raise ValueError(f"length distribution {spec!r} needs finite numbers")
        ok = {
            "const": self.a >= 1,
            "uniform": 1 <= self.a <= self.b,
            "exp": self.a > 0,
            "lognormal": self.a > 0 and self.b >= 0,
        }[self.kind]
        if not ok:
            raise ValueError(f"out-of-range parameters in length distribution {spec!r}")

    def sample(self, rng: random.Random) -> int:
        """One draw, at least 1."""
        if self.kind == "const":
            x = self.a
        elif self.kind == "uniform":
            x = rng.randint(int(self.a), int(self.b))
        elif self.kind == "exp":
            # 1/MEAN is inf for a subnormal MEAN: expovariate then draws 0.
            x = math.ceil(min(rng.expovariate(1.0 / self.a), MAX_LENGTH))
        else:
            # lognormvariate(mu, sigma) is exp(normalvariate(mu, sigma)): the
            # same draw, capped before exp can overflow.
            z = rng.normalvariate(math.log(self.a), self.b)
            x = math.exp(min(z, math.log(MAX_LENGTH)))
        return max(1, min(round(x), MAX_LENGTH))

    def __str__(self) -> str:
        if self.kind in ("const", "exp"):
            return f"{self.kind}:{self.a:g}"
        return f"{self.kind}:{self.a:g}:{self.b:g}"


@dataclass(frozen=True)
class RequestSpec:
    """One request of the workload: when it arrives and how long it is."""

    rid: int
    arrival_s: float  # seconds after the start of the run
    prompt_len: int
    output_len: int
    abort: str = ""  # "", "transfer" or "decode": when the client aborts it
    abort_at: float = 0.0  # the fraction of the transfer / of the output done by then

    @property
    def abort_after(self) -> int:
        """For a decode abort: output tokens generated when the client aborts."""
        return max(1, min(self.output_len - 1, int(self.abort_at * self.output_len)))


@dataclass(frozen=True)
class WorkloadConfig:
    """What :func:`generate` draws. ``rate`` is requests per second; 0 = all at once."""

    num_requests: int
    rate: float
    prompt_len: LengthDist
    output_len: LengthDist
    max_total_len: int
    seed: int = 0
    abort_rate: float = 0.0


def generate(cfg: WorkloadConfig) -> list[RequestSpec]:
    """Draw ``cfg.num_requests`` requests, sorted by arrival; same seed, same list."""
    if cfg.num_requests < 0:
        raise ValueError("num_requests must be >= 0")
    if cfg.rate < 0:
        raise ValueError("rate must be >= 0 (0 means every request arrives at once)")
    if cfg.max_total_len < 2:
        raise ValueError("max_total_len must be >= 2")
    if not 0.0 <= cfg.abort_rate <= 1.0:
        raise ValueError("abort_rate must be in [0, 1]")
    rng = random.Random(cfg.seed)
    aborts = random.Random(f"abort:{cfg.seed}")
    t = 0.0
    out: list[RequestSpec] = []
    for rid in range(cfg.num_requests):
        if cfg.rate > 0:
            t += rng.expovariate(cfg.rate)
        prompt = min(cfg.prompt_len.sample(rng), cfg.max_total_len - 1)
        output = min(cfg.output_len.sample(rng), cfg.max_total_len - prompt)
        kind, at = "", 0.0
        if aborts.random() < cfg.abort_rate:
            # A decode abort needs at least two output tokens to land mid-decode.
            kind = "transfer" if output < 2 or aborts.random() < 0.5 else "decode"
            at = aborts.uniform(0.05, 0.6)
        out.append(RequestSpec(rid, t, prompt, output, kind, at))
    return out
