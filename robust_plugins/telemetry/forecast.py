"""Convergence forecast: a power law of loss against step, fitted by least squares, with an interval.

``log(loss) = log(A) - c * log(step)`` is a straight line in log-log space (training loss of
language models falls close to a power law in steps once past the first few percent of training),
so ordinary least squares on ``(log step, log loss)`` gives the fit and the textbook prediction
interval for a new point; both are mapped back with ``exp``. Only the second half of the points
is fitted: the first steps fall much faster than the law and would bias the slope.
This is a forecast, not a guarantee: learning-rate schedules and plateaus bend the curve.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

#: Student t 97.5 % quantiles by degrees of freedom (two-sided 95 % interval); above 30, ~1.96.
_T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262,
         10: 2.228, 12: 2.179, 15: 2.131, 20: 2.086, 25: 2.060, 30: 2.042}


def _t975(dof: int) -> float:
    if dof >= 30:
        return 1.96 + 2.4 / dof  # within 0.5 % of the exact quantile for dof >= 30
    keys = [k for k in sorted(_T975) if k <= dof]
    return _T975[keys[-1]]


@dataclass(frozen=True)
class PowerLawFit:
    """``loss ~ exp(intercept) * step ** slope`` with what the prediction interval needs."""

    intercept: float
    slope: float
    sigma: float
    n: int
    x_mean: float
    sxx: float

    def predict(self, step: float) -> tuple[float, float, float]:
        """(forecast, low, high) of the loss at ``step``: a 95 % prediction interval."""
        if step <= 0:
            raise ValueError(f"step = {step} must be > 0 to forecast a power law")
        x = math.log(step)
        y = self.intercept + self.slope * x
        se = self.sigma * math.sqrt(1 + 1 / self.n + (x - self.x_mean) ** 2 / self.sxx)
        t = _t975(self.n - 2)
        return math.exp(y), math.exp(y - t * se), math.exp(y + t * se)


def fit_power_law(steps: Sequence[float], losses: Sequence[float], tail_fraction: float = 0.5) -> PowerLawFit | None:
    """Fit the last ``tail_fraction`` of the finite, positive points; None with fewer than 4."""
    pts = [(float(s), float(v)) for s, v in zip(steps, losses)
           if v is not None and s is not None and s > 0 and v > 0 and math.isfinite(v)]
    pts = pts[int(len(pts) * (1 - tail_fraction)):] if len(pts) >= 8 else pts
    if len(pts) < 4:
        return None
    xs = [math.log(s) for s, _ in pts]
    ys = [math.log(v) for _, v in pts]
    n = len(xs)
    xm, ym = sum(xs) / n, sum(ys) / n
    sxx = sum((x - xm) ** 2 for x in xs)
    if sxx == 0:
        return None
    slope = sum((x - xm) * (y - ym) for x, y in zip(xs, ys)) / sxx
    intercept = ym - slope * xm
    resid = [y - (intercept + slope * x) for x, y in zip(xs, ys)]
    sigma = math.sqrt(sum(r * r for r in resid) / (n - 2))
    return PowerLawFit(intercept, slope, sigma, n, xm, sxx)
