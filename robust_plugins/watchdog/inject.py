"""Fault injection specs for ``robust run --inject`` (parsing only; ranks fire them in ``client``).

Syntax: ``KIND:rank=R,step=S[,key=value...]``; several faults are separated by ``;`` or given as
several ``--inject`` flags. A fault fires once per job: when rank ``R`` reports the end of step
``S`` (``robust_plugins.watchdog.step_end(S)``) for the first time (``bitflip``: in its first
``check_params`` at or after ``S``); a restarted job that replays step ``S`` does not fire it again.

=========================  ==================================================================
``kill:rank=1,step=30``    rank 1 kills itself with SIGKILL (``signal=TERM`` etc. to choose)
``hang:rank=0,step=20``    rank 0 sleeps in a Python loop (``time.sleep``), so its peers
                           block in their next collective; ``mode=syscall`` blocks in one
                           system call instead (``select`` on a pipe nobody writes)
``nan:rank=1,step=40``     rank 1 reports a NaN loss for step 40 (``what=grad_norm`` for the
                           gradient norm); the model itself is not touched
``spike:rank=1,step=40``   rank 1 reports 1000 x its loss (or ``what=grad_norm``) for step 40
``bitflip:rank=2,step=30`` rank 2 flips bit 20 (``bit=N``) of its first parameter's first element
                           in the first ``check_params`` at or after step 30: real corruption
                           (bits of a float32 word; a bfloat16 parameter holds bits 16 to 31)
``stuckbit:rank=2,step=30`` as ``bitflip``, but in every incarnation that replays that check: a
                           persistent fault (hardware that corrupts the same step again)
``slow:rank=1,step=10``    from step 10 on, rank 1 sleeps 0.5 s (``seconds=X``) outside any
                           collective before reporting each step: a persistent straggler
``badbatch:rank=1,step=40`` a spike (as ``spike``) every time step 40 is trained, in every
                           incarnation: a batch that reproduces its spike. It does not fire
                           when the script skips that batch (``watchdog.skip_batch``)
=========================  ==================================================================
"""

from __future__ import annotations

import signal as _signal
from dataclasses import dataclass

from robust_plugins.errors import ConfigError

#: kind -> optional keys with their allowed values (``None``: any value checked elsewhere).
KINDS: dict[str, dict[str, tuple[str, ...] | None]] = {
    "kill": {"signal": None},
    "hang": {"mode": ("python", "syscall")},
    "nan": {"what": ("loss", "grad_norm")},
    "spike": {"what": ("loss", "grad_norm")},
    "bitflip": {"bit": None},
    "stuckbit": {"bit": None},
    "slow": {"seconds": None},
    "badbatch": {"what": ("loss", "grad_norm")},
}

#: Kinds that fire again in every incarnation that replays their step (not once per job).
RECURRING_KINDS = ("badbatch", "stuckbit")

#: Kinds fired by ``check_params`` (the others fire in ``step_end``).
PARAM_KINDS = ("bitflip", "stuckbit")

#: Default extra seconds a ``slow`` rank spends per step.
SLOW_DEFAULT_S = 0.5

#: Longest ``slow`` delay accepted: more is a hang, not a straggler.
SLOW_MAX_S = 60.0

#: A spike multiplies the reported value by this (far above any sensible spike_factor).
SPIKE_MULTIPLIER = 1000.0

FORMS = (
    "kill:rank=R,step=S[,signal=KILL|TERM|SEGV|ABRT...]",
    "hang:rank=R,step=S[,mode=python|syscall]",
    "nan:rank=R,step=S[,what=loss|grad_norm]",
    "spike:rank=R,step=S[,what=loss|grad_norm]",
    "bitflip:rank=R,step=S[,bit=0..31]",
    "stuckbit:rank=R,step=S[,bit=0..31]",
    "slow:rank=R,step=S[,seconds=X]",
    "badbatch:rank=R,step=S[,what=loss|grad_norm]",
)


@dataclass(frozen=True)
class Injection:
    """One fault to inject."""

    kind: str
    """``kill``, ``hang``, ``nan``, ``spike``, ``bitflip``, ``slow`` or ``badbatch``."""

    rank: int
    """Global rank that misbehaves."""

    step: int
    """Step (as the script reports it to ``step_end``) at whose end the fault fires."""

    option: str = ""
    """The kind's option: signal name for ``kill``, ``python`` or ``syscall`` for ``hang``, ``loss`` or
    ``grad_norm`` for ``nan``, ``spike`` and ``badbatch``, the bit index for ``bitflip`` and ``stuckbit``, seconds per step for
    ``slow``."""

    def spec(self) -> str:
        """The canonical text form; ``parse(x.spec()) == [x]``."""
        (key,) = KINDS[self.kind]
        return f"{self.kind}:rank={self.rank},step={self.step},{key}={self.option}"

    @property
    def signum(self) -> int:
        """The signal number of a ``kill`` fault."""
        return int(getattr(_signal, "SIG" + self.option))


def _error(part: str, why: str) -> ConfigError:
    forms = "; ".join(FORMS)
    return ConfigError(f"--inject {part!r}: {why}. Allowed forms: {forms} (several separated by ';').")


def parse_one(text: str) -> Injection:
    """Parse one ``KIND:key=value,...`` spec; errors name the bad part and the allowed forms."""
    part = text.strip()
    kind, sep, rest = part.partition(":")
    kind = kind.strip().lower()
    if kind not in KINDS:
        raise _error(part, f"unknown fault kind {kind!r} (known: {', '.join(KINDS)})")
    if not sep or not rest.strip():
        raise _error(part, "missing ':rank=R,step=S'")
    values: dict[str, str] = {}
    for item in rest.split(","):
        key, eq, value = item.partition("=")
        key, value = key.strip().lower(), value.strip()
        if not eq or not key or not value:
            raise _error(part, f"{item.strip()!r} is not key=value")
        if key in values:
            raise _error(part, f"{key!r} is given twice")
        values[key] = value
    allowed = ("rank", "step", *KINDS[kind])
    for key in values:
        if key not in allowed:
            raise _error(part, f"unknown key {key!r} for {kind} (allowed: {', '.join(allowed)})")
    for key in ("rank", "step"):
        if key not in values:
            raise _error(part, f"{key}= is required")
        if not values[key].isdigit():
            raise _error(part, f"{key}={values[key]!r} must be a non-negative integer")
    option = _option(part, kind, values)
    return Injection(kind, int(values["rank"]), int(values["step"]), option)


def _option(part: str, kind: str, values: dict[str, str]) -> str:
    (key,) = KINDS[kind]
    allowed = KINDS[kind][key]
    if kind in ("bitflip", "stuckbit"):
        bit = values.get(key, "20")
        if not bit.isdigit() or not 0 <= int(bit) <= 31:
            raise _error(part, f"bit={bit!r} must be an integer from 0 to 31")
        return str(int(bit))
    if kind == "slow":
        text = values.get(key, str(SLOW_DEFAULT_S))
        try:
            seconds = float(text)
        except ValueError:
            seconds = float("nan")
        if not 0 < seconds <= SLOW_MAX_S:
            raise _error(part, f"seconds={text!r} must be a number in (0, {SLOW_MAX_S:g}]")
        return repr(seconds)
    if kind == "kill":
        name = values.get(key, "KILL").upper().removeprefix("SIG")
        if not isinstance(getattr(_signal, "SIG" + name, None), _signal.Signals):
            raise _error(part, f"signal={values[key]!r} is not a signal name (e.g. KILL, TERM, SEGV)")
        return name
    value = values.get(key, allowed[0]).lower()
    if value not in allowed:
        raise _error(part, f"{key}={values[key]!r} is not one of {', '.join(allowed)}")
    return value


def parse(specs: str | list[str] | tuple[str, ...] | None) -> list[Injection]:
    """Parse ``--inject`` values (each may hold several specs separated by ``;``)."""
    if specs is None:
        return []
    if isinstance(specs, str):
        specs = [specs]
    out: list[Injection] = []
    for text in specs:
        for part in text.split(";"):
            if part.strip():
                out.append(parse_one(part))
    keys = [(i.rank, i.step) for i in out]
    for key in set(keys):
        if keys.count(key) > 1:
            raise _error(";".join(specs), f"two faults for rank {key[0]} at step {key[1]}; one fires")
    return out


def check_world(injections: list[Injection], world_size: int) -> None:
    """Refuse faults aimed at ranks the job does not have."""
    for inj in injections:
        if inj.rank >= world_size:
            raise _error(inj.spec(), f"rank {inj.rank} does not exist in a job of {world_size} ranks")


def to_env(injections: list[Injection]) -> str:
    """The ``ROBUST_INJECT`` value the ranks parse back."""
    return ";".join(i.spec() for i in injections)
