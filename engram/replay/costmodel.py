"""Replay cost model: predict, from a machine's measurements, what a session's resume costs in each mode, and
pick the mode per session (docs/REPLAY.md, "Cost model").

A session's sliding-window KV comes back on Resume in one of three ways (engram.api.SessionMode): loaded from
where it was persisted (costs storage, exact), replayed exactly (R = L_swa * (W - 1) tokens, exact), or
replayed approximately (R = ceil(k * W), cheaper, not exact). Which one is fastest depends on the model and the
machine, and whether it is allowed depends on the storage left for persisted windows and on the fidelity the
operator asks for. The numbers come from a benchmark's JSON (schema "engram.replay_cost/1"); this module fits
them and answers. It is pure: no torch at import, no store, no gRPC; the session manager calls it.

What is left out on purpose: the global-KV load, which every mode needs alike, and batching several sessions
into one replay.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import re
import socket
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from engram.api import SessionMode

SCHEMA = "engram.replay_cost/1"
TIERS = ("hbm", "dram", "nvme")
DEVICES = ("cuda", "cpu")
SOURCES = ("named", "checkpoint")


# ---- data ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelInfo:
    name: str
    source: str  # "named" (a preset) or "checkpoint" (real weights)
    weights_id: str
    layers: int
    sliding_layers: int
    global_layers: int
    window: int
    n_kv_heads: int
    head_dim: int
    dtype: str

    @property
    def exact_bound(self) -> int:
        """L_swa * (W - 1), as engram.replay.exact_bound: the replay length past which nothing changes."""
        return self.sliding_layers * (self.window - 1)


@dataclass(frozen=True)
class MachineInfo:
    id: str
    device: str  # "cuda" or "cpu"
    device_name: str
    torch: str


@dataclass(frozen=True)
class ReplayPoint:
    context: int
    replayed: int
    label: str  # "W", "2W", ..., "exact"
    seconds: float
    token_layers: int  # rows entering each layer, summed (0: not measured)


@dataclass(frozen=True)
class LoadPoint:
    tier: str
    bytes: int
    seconds: float


@dataclass(frozen=True)
class FidelityPoint:
    replayed: int
    label: str
    kv_rel_error: float
    kl: float
    top1: float


@dataclass(frozen=True)
class PersistedPoint:
    context: int
    global_bytes: int
    window_bytes: int


@dataclass(frozen=True)
class Fidelity:
    """How close a resumed session's next-token distribution is to an uninterrupted one's."""

    top1: float  # agreement of the argmax, 1.0 = always
    kl: float  # KL(reference || resumed), 0 = same distribution
    kv_rel_error: float  # of the rebuilt window, max |diff| / max |reference|

    def worse(self, other: Fidelity) -> Fidelity:
        """Each measure at the worse of the two: what interpolation may promise between measured points."""
        return Fidelity(min(self.top1, other.top1), max(self.kl, other.kl),
                        max(self.kv_rel_error, other.kv_rel_error))


EXACT = Fidelity(1.0, 0.0, 0.0)  # persist and exact replay: exact by construction, whatever bf16 rounding measured
UNKNOWN = Fidelity(0.0, math.inf, math.inf)  # below the shortest measured replay: promises nothing


@dataclass(frozen=True)
class FidelityFloor:
    """The operator's minimum: an option whose fidelity misses any set bound is not allowed."""

    min_top1: float | None = None
    max_kl: float | None = None
    max_kv_rel_error: float | None = None

    def allows(self, f: Fidelity) -> bool:
        return ((self.min_top1 is None or f.top1 >= self.min_top1)
                and (self.max_kl is None or f.kl <= self.max_kl)
                and (self.max_kv_rel_error is None or f.kv_rel_error <= self.max_kv_rel_error))


@dataclass(frozen=True)
class LinearFit:
    """y = intercept + slope * x with both >= 0, so a prediction is never negative nor falls as x grows."""

    intercept: float
    slope: float

    def __call__(self, x: float) -> float:
        return self.intercept + self.slope * x


@dataclass(frozen=True)
class ReplayFit:
    """seconds = intercept + per_token_layer * TL + per_token_layer_context * TL * P, all >= 0.

    TL (token_layers) is the replay's work in rows through layers. The TL * P term is the global layers'
    attention over all P stored keys, the one cost that grows with the context (docs/REPLAY.md, "Cost"); it is
    fitted only when the points span two contexts or more, and is 0 otherwise.

    `overlapped`: seconds = max(intercept, TL * (per_token_layer + per_token_layer_context * P)) instead. A GPU
    replay of a short span is bound by the host launching its kernels (a floor of ~20-27 ms for 24 layers on
    the H200, whatever R), and the device's work overlaps that until it exceeds it: a sum charges both."""

    intercept: float
    per_token_layer: float
    per_token_layer_context: float
    overlapped: bool = False

    def __call__(self, token_layers: float, context: float) -> float:
        work = token_layers * (self.per_token_layer + self.per_token_layer_context * context)
        return max(self.intercept, work) if self.overlapped else self.intercept + work


@dataclass(frozen=True)
class Calibration:
    """One model on one machine: the benchmark's points and the fits made from them. Build with from_json,
    from_file or load; to_json gives the file back (the fits are recomputed on reading)."""

    model: ModelInfo
    machine: MachineInfo
    date: str
    replay_points: tuple[ReplayPoint, ...]
    load_points: tuple[LoadPoint, ...]
    fidelity_points: tuple[FidelityPoint, ...]
    persisted_points: tuple[PersistedPoint, ...]
    replay_fit: ReplayFit | None = field(init=False)  # None: some point lacks token_layers (or no points)
    replay_fit_by_r: tuple[tuple[int, LinearFit], ...] = field(init=False)  # per R: seconds ~ a + b * context
    load_fits: tuple[tuple[str, LinearFit], ...] = field(init=False)  # per tier: seconds ~ latency + s/byte

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        set_(self, "replay_fit", _fit_replay(self.replay_points))
        by_r: dict[int, list[ReplayPoint]] = {}
        for p in self.replay_points:
            if p.replayed > 0:  # a replay of nothing costs nothing: no point in fitting it
                by_r.setdefault(p.replayed, []).append(p)
        set_(self, "replay_fit_by_r", tuple(
            (r, _line([float(p.context) for p in ps], [p.seconds for p in ps])) for r, ps in sorted(by_r.items())))
        by_tier: dict[str, list[LoadPoint]] = {}
        for q in self.load_points:
            by_tier.setdefault(q.tier, []).append(q)
        set_(self, "load_fits", tuple(
            (t, _line([float(q.bytes) for q in qs], [q.seconds for q in qs], slope_first=True))
            for t, qs in sorted(by_tier.items())))

    # ---- JSON --------------------------------------------------------------------------------------

    @classmethod
    def from_json(cls, data: Any, source: str = "<calibration>") -> Calibration:
        """Validate and fit. Raises ValueError naming `source` and the offending field."""
        return _parse(data, source)

    @classmethod
    def from_file(cls, path: str | Path) -> Calibration:
        path = Path(path)
        try:
            data = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"{path}: not a JSON calibration ({e})") from None
        return _parse(data, str(path))

    def to_json(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA,
            "model": vars(self.model).copy(),
            "machine": vars(self.machine).copy(),
            "date": self.date,
            "replay": [vars(p).copy() for p in self.replay_points],
            "load": [vars(p).copy() for p in self.load_points],
            "fidelity": [vars(p).copy() for p in self.fidelity_points],
            "persisted": [vars(p).copy() for p in self.persisted_points],
        }

    # ---- storage: one file per (weights, machine) --------------------------------------------------

    def save(self, directory: str | Path) -> Path:
        """Write to `directory` under the name `load` looks for; atomic (a reader never sees half a file)."""
        path = calibration_path(directory, self.model.weights_id, self.machine.id)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(self.to_json(), indent=1, sort_keys=True) + "\n")
        tmp.replace(path)
        return path

    @classmethod
    def load(cls, directory: str | Path, weights_id: str, machine_id: str) -> Calibration | None:
        """The calibration of these weights on this machine, or None where none was saved. A file that is
        there but malformed, or that belongs to other weights or another machine, raises ValueError."""
        path = calibration_path(directory, weights_id, machine_id)
        if not path.exists():
            return None
        cal = cls.from_file(path)
        if cal.model.weights_id != weights_id:
            raise ValueError(f"{path}: field 'model.weights_id' is {cal.model.weights_id!r}, expected {weights_id!r}")
        if cal.machine.id != machine_id:
            raise ValueError(f"{path}: field 'machine.id' is {cal.machine.id!r}, expected {machine_id!r}")
        return cal


def _safe(part: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]", "_", part)[:64].strip(".") or "_"


def calibration_path(directory: str | Path, weights_id: str, machine_id: str) -> Path:
    """replay_cost.<weights>.<machine>.<hash>.json: readable parts, sanitized, and a hash of the exact pair so
    that two ids sanitizing alike ("a/b", "a_b") never share a file."""
    digest = hashlib.sha256(json.dumps([weights_id, machine_id]).encode()).hexdigest()[:12]
    return Path(directory) / f"replay_cost.{_safe(weights_id)}.{_safe(machine_id)}.{digest}.json"


def machine_id(device: str = "auto") -> str:
    """hostname/device: the name of the CUDA device replay runs on, or "cpu" (device "cpu", or no CUDA).
    Calibrations are per machine because replay time depends on the accelerator and load time on the host's
    memory and disks."""
    import torch  # here, not at import: the module stays light for callers that only read calibrations

    cuda = device != "cpu" and torch.cuda.is_available()
    name = torch.cuda.get_device_name(torch.device(device) if device.startswith("cuda:") else 0) if cuda else "cpu"
    return f"{socket.gethostname()}/{name}"


# ---- fitting -------------------------------------------------------------------------------------------


def _nnls(columns: Sequence[Sequence[float]], y: Sequence[float]) -> list[float]:
    """Least squares with every coefficient >= 0, by trying each set of columns (exact for the 2-3 unknowns
    here: the constrained optimum is the plain fit on its own support). Columns are scaled first, so seconds
    against bytes stays well conditioned; among equally good fits the earlier column set wins, so the caller's
    column order says what to prefer when the points cannot tell (one point: proportional, not constant)."""
    x = np.asarray(columns, dtype=np.float64).T
    target = np.asarray(y, dtype=np.float64)
    scale = np.abs(x).max(axis=0)
    scale[scale == 0] = 1.0
    xs = x / scale
    m = x.shape[1]
    best, best_res = np.zeros(m), float(target @ target)
    tol = 1e-12 * max(best_res, 1e-300)
    for size in range(m, 0, -1):
        for support in itertools.combinations(range(m), size):
            sub = xs[:, list(support)]
            if np.linalg.matrix_rank(sub) < size:
                continue
            coef, *_ = np.linalg.lstsq(sub, target, rcond=None)
            if (coef < 0).any():
                continue
            res = float(np.sum((sub @ coef - target) ** 2))
            if res < best_res - tol:
                best, best_res = np.zeros(m), res
                best[list(support)] = coef
    return [float(v) for v in best / scale]


def _line(x: Sequence[float], y: Sequence[float], *, slope_first: bool = False) -> LinearFit:
    ones = [1.0] * len(x)
    if slope_first:  # load: one point means bandwidth, not a fixed latency
        slope, intercept = _nnls([x, ones], y)
    else:  # replay per R: one context means a constant
        intercept, slope = _nnls([ones, x], y)
    return LinearFit(intercept, slope)


def _fit_replay(points: Sequence[ReplayPoint]) -> ReplayFit | None:
    points = [p for p in points if p.replayed > 0]
    if not points or any(p.token_layers <= 0 for p in points):
        return None
    tl = [float(p.token_layers) for p in points]
    seconds = [p.seconds for p in points]
    spans = len({p.context for p in points}) > 1
    cols = [tl, [1.0] * len(points)]
    if spans:
        cols.append([p.token_layers * float(p.context) for p in points])
    coef = _nnls(cols, seconds)
    best = ReplayFit(intercept=coef[1], per_token_layer=coef[0], per_token_layer_context=coef[2] if spans else 0.0)

    def loss(fit: ReplayFit) -> float:  # relative: the target is "within 20%" of each point
        return sum((fit(p.token_layers, p.context) / p.seconds - 1) ** 2 for p in points if p.seconds > 0)

    # The overlapped form: for each floor a point could set, the work terms fitted to the points clearly above
    # it (10%: the floor's own noise must not be read as work). Points above it from one context only cannot
    # tell TL from TL * P apart; growth with R that shows at one long context is attention over its P keys.
    for floor in sorted(set(seconds)):
        above = [p for p in points if p.seconds > 1.1 * floor]
        if not above:
            continue
        per_tl = [float(p.token_layers) for p in above]
        per_tlp = [p.token_layers * float(p.context) for p in above]
        if len({p.context for p in above}) > 1:
            w = _nnls([per_tl, per_tlp], [p.seconds for p in above])
        else:
            ys = [p.seconds for p in above]
            w = [0.0, *_nnls([per_tlp], ys)] if spans else [*_nnls([per_tl], ys), 0.0]
        fit = ReplayFit(floor, w[0], w[1], overlapped=True)
        if loss(fit) < loss(best):
            best = fit
    return best


# ---- parsing -------------------------------------------------------------------------------------------


class _Fields:
    """Reads one JSON object, naming the file and the field path in every error."""

    def __init__(self, source: str, where: str, obj: Any) -> None:
        if not isinstance(obj, Mapping):
            raise ValueError(f"{source}: field '{where or '<top>'}' must be an object, got {type(obj).__name__}")
        self.source, self.where, self.obj = source, where, obj

    def _name(self, key: str) -> str:
        return f"{self.where}.{key}" if self.where else key

    def _get(self, key: str) -> Any:
        if key not in self.obj:
            raise ValueError(f"{self.source}: field '{self._name(key)}' is missing")
        return self.obj[key]

    def fail(self, key: str, what: str) -> ValueError:
        return ValueError(f"{self.source}: field '{self._name(key)}' {what}, got {self.obj.get(key)!r}")

    def text(self, key: str, choices: Sequence[str] | None = None) -> str:
        v = self._get(key)
        if not isinstance(v, str) or (choices is not None and v not in choices):
            raise self.fail(key, f"must be one of {list(choices)}" if choices else "must be a string")
        return v

    def integer(self, key: str, minimum: int = 0, default: int | None = None) -> int:
        if default is not None and self.obj.get(key) is None:
            return default
        v = self._get(key)
        if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
            raise self.fail(key, f"must be an integer >= {minimum}")
        return v

    def number(self, key: str, lo: float = 0.0, hi: float = math.inf) -> float:
        v = self._get(key)
        if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or not lo <= v <= hi:
            raise self.fail(key, f"must be a finite number in [{lo}, {hi}]")
        return float(v)

    def objects(self, key: str) -> list[_Fields]:
        v = self._get(key)
        if not isinstance(v, list):
            raise self.fail(key, "must be a list")
        return [_Fields(self.source, f"{self._name(key)}[{i}]", item) for i, item in enumerate(v)]

    def sub(self, key: str) -> _Fields:
        return _Fields(self.source, self._name(key), self._get(key))


def _parse(data: Any, source: str) -> Calibration:
    top = _Fields(source, "", data)
    if top.obj.get("schema") != SCHEMA:
        raise top.fail("schema", f"must be {SCHEMA!r}")
    m = top.sub("model")
    model = ModelInfo(
        name=m.text("name"), source=m.text("source", SOURCES), weights_id=m.text("weights_id"),
        layers=m.integer("layers", 1), sliding_layers=m.integer("sliding_layers"),
        global_layers=m.integer("global_layers"),
        window=m.integer("window", 1), n_kv_heads=m.integer("n_kv_heads", 1), head_dim=m.integer("head_dim", 1),
        dtype=m.text("dtype"))
    if model.sliding_layers + model.global_layers > model.layers:
        raise m.fail("sliding_layers", f"plus global_layers ({model.global_layers}) must be <= layers "
                                       f"({model.layers})")
    h = top.sub("machine")
    machine = MachineInfo(id=h.text("id"), device=h.text("device", DEVICES), device_name=h.text("device_name"),
                          torch=h.text("torch"))
    replay = tuple(ReplayPoint(context=p.integer("context"), replayed=p.integer("replayed"), label=p.text("label"),
                               seconds=p.number("seconds"), token_layers=p.integer("token_layers", default=0))
                   for p in top.objects("replay"))
    load = tuple(LoadPoint(tier=p.text("tier", TIERS), bytes=p.integer("bytes"), seconds=p.number("seconds"))
                 for p in top.objects("load"))
    fidelity = tuple(FidelityPoint(replayed=p.integer("replayed"), label=p.text("label"),
                                   kv_rel_error=p.number("kv_rel_error"), kl=p.number("kl"),
                                   top1=p.number("top1", 0.0, 1.0))
                     for p in top.objects("fidelity"))
    persisted = tuple(PersistedPoint(context=p.integer("context"), global_bytes=p.integer("global_bytes"),
                                     window_bytes=p.integer("window_bytes"))
                      for p in top.objects("persisted"))
    return Calibration(model, machine, top.text("date"), replay, load, fidelity, persisted)


_ITEMSIZE = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1}
_K_LABEL = re.compile(r"^([0-9]*\.?[0-9]*)W$")


def _label_k(label: str) -> float | None:
    """"W" -> 1, "2W" -> 2, "0.5W" -> 0.5; anything else -> None."""
    m = _K_LABEL.match(label)
    if not m:
        return None
    try:
        k = float(m.group(1)) if m.group(1) else 1.0
    except ValueError:
        return None
    return k if k > 0 else None


# ---- predictions and the choice ------------------------------------------------------------------------


@dataclass(frozen=True)
class Option:
    """One way to resume a session, priced. `allowed` is False with `why` when the budget or floor rules it out."""

    mode: SessionMode
    approx_k: float  # approx only, else 0.0 (what SessionManager.open takes)
    replayed: int  # tokens replayed; 0 for persist
    predicted_s: float
    fidelity: Fidelity
    allowed: bool
    why: str


@dataclass(frozen=True)
class Choice:
    """The fastest allowed option. mode is a SessionMode, a str: "persist", "exact" or "approx"."""

    mode: SessionMode
    approx_k: float
    predicted_s: float
    reason: str


class NoAllowedOption(ValueError):
    """No option passes the budget and the floor (and exact replay is out): each option's refusal is listed."""

    def __init__(self, options: Sequence[Option]) -> None:
        self.options = tuple(options)
        why = "; ".join(f"{_name(o)}: {o.why}" for o in self.options) or "no options"
        super().__init__(f"no resume mode is allowed: {why}")


def _name(o: Option) -> str:
    return f"approx k={o.approx_k:g}" if o.mode is SessionMode.APPROX else o.mode.value


def _ms(s: float) -> str:
    return f"{s * 1e3:.3g} ms"


@dataclass(frozen=True)
class CostModel:
    """Predictions from one Calibration. Pure and cheap: the session manager may ask per session."""

    calibration: Calibration

    @property
    def exact_bound(self) -> int:
        return self.calibration.model.exact_bound

    def replay_length(self, context: int, replayed: int) -> int:
        """What a replay really runs, as engram.replay.replay_length: never past the exact bound nor the prefix."""
        return max(0, min(replayed, self.exact_bound, context))

    def token_layers(self, context: int, replayed: int) -> float:
        """Predicted work of a replay, from the token_layers measured at the nearest context (interpolated in R;
        past the largest measured R each extra token is counted through every layer, an upper bound). Without
        measurements: layers * R, the flat replay."""
        r = self.replay_length(context, replayed)
        layers = self.calibration.model.layers
        pts = [p for p in self.calibration.replay_points if p.token_layers > 0]
        if r == 0:
            return 0.0
        if not pts:
            return float(layers * r)
        near = min({p.context for p in pts}, key=lambda c: (abs(math.log(max(c, 1) / max(context, 1))), -c))
        table: dict[int, int] = {0: 0}  # flat and cone points at one R: the larger (flat), to overestimate
        for p in pts:
            if p.context == near:
                table[p.replayed] = max(table.get(p.replayed, 0), p.token_layers)
        rs = sorted(table)
        if r >= rs[-1]:
            return float(table[rs[-1]] + layers * (r - rs[-1]))
        hi = next(i for i, x in enumerate(rs) if x >= r)
        r0, r1 = rs[hi - 1], rs[hi]
        if r1 == r:
            return float(table[r1])
        return table[r0] + (table[r1] - table[r0]) * (r - r0) / (r1 - r0)

    def predict_replay(self, context: int, replayed: int) -> float:
        """Seconds to replay `replayed` tokens of a `context`-token session (clamped as the replay clamps)."""
        cal = self.calibration
        r = self.replay_length(context, replayed)
        if r == 0:
            return 0.0
        if cal.replay_fit is not None:
            return cal.replay_fit(self.token_layers(context, r), context)
        if not cal.replay_fit_by_r:
            raise ValueError(f"no replay measurements for {cal.model.weights_id} on {cal.machine.id}")
        # Per measured R: interpolate between neighbours; below the least, its time (a shorter replay costs no
        # more); past the largest, in proportion to R (overestimates: the fixed part is counted again).
        fits = cal.replay_fit_by_r
        if r <= fits[0][0]:
            return fits[0][1](context)
        if r >= fits[-1][0]:
            return fits[-1][1](context) * r / fits[-1][0]
        hi = next(i for i, (x, _) in enumerate(fits) if x >= r)
        (r0, f0), (r1, f1) = fits[hi - 1], fits[hi]
        return f0(context) + (f1(context) - f0(context)) * (r - r0) / (r1 - r0)

    def predict_load(self, tier: str, nbytes: int) -> float:
        """Seconds to bring `nbytes` from `tier` to where the replay would have put them."""
        fits = dict(self.calibration.load_fits)
        if tier not in fits:
            raise ValueError(f"no load measurements for tier {tier!r} (measured: {sorted(fits)})")
        return fits[tier](nbytes) if nbytes > 0 else 0.0

    def fidelity(self, replayed: int, context: int | None = None) -> Fidelity:
        """Measured fidelity of an R-token replay. Between two measured R, the worse neighbour; below the least
        measured, UNKNOWN (allowed by no floor). R at the exact bound, or covering the whole context, is exact."""
        if replayed >= self.exact_bound or (context is not None and replayed >= context):
            return EXACT
        table: dict[int, Fidelity] = {}
        for f in self.calibration.fidelity_points:
            if f.label == "exact" or f.replayed >= self.exact_bound:
                continue
            got = Fidelity(f.top1, f.kl, f.kv_rel_error)
            table[f.replayed] = table[f.replayed].worse(got) if f.replayed in table else got
        lower = [r for r in table if r <= replayed]
        if not lower:
            return UNKNOWN
        below = table[max(lower)]
        upper = [r for r in table if r >= replayed]
        return below.worse(table[min(upper)]) if upper else below

    def window_bytes(self, context: int) -> int | None:
        """Bytes of a persisted window: the measured value at this context, else the largest measured (a window
        stops growing at W - 1 rows). Without measurements, K and V of min(W - 1, P) rows per sliding layer in
        the model's dtype; None where that dtype is not one we know the size of."""
        sizes = {p.context: p.window_bytes for p in self.calibration.persisted_points}
        if sizes:
            return sizes.get(context, max(sizes.values()))
        m = self.calibration.model
        itemsize = _ITEMSIZE.get(m.dtype.removeprefix("torch."))
        if itemsize is None:
            return None
        return m.sliding_layers * 2 * min(m.window - 1, max(context, 0)) * m.n_kv_heads * m.head_dim * itemsize

    def approx_ks(self) -> list[float]:
        """The k the fidelity table measured below the exact bound: the approx options on offer."""
        w = self.calibration.model.window
        ks = set()
        for f in self.calibration.fidelity_points:
            if f.label != "exact" and 0 < f.replayed < self.exact_bound:
                k = _label_k(f.label)
                ks.add(k if k is not None else f.replayed / w)
        return sorted(ks)

    def options(self, context: int, *, budget_bytes: int, floor: FidelityFloor = FidelityFloor(),
                tier: str = "dram", window_bytes: int | None = None, can_replay: bool = True) -> list[Option]:
        """Every option for a session of `context` tokens, priced and judged. budget_bytes: what is left of the
        persisted-window budget; tier: where a persisted window would live; can_replay: False where the daemon
        has no replay model for these weights."""
        out: list[Option] = []
        need = self.window_bytes(context) if window_bytes is None else window_bytes
        if need is None:
            out.append(Option(SessionMode.PERSIST, 0.0, 0, math.inf, EXACT, False,
                              f"window size unknown (no persisted points, dtype {self.calibration.model.dtype!r})"))
        elif need > budget_bytes:
            out.append(Option(SessionMode.PERSIST, 0.0, 0, math.inf, EXACT, False,
                              f"its window needs {need} B, {max(budget_bytes, 0)} B of the budget left"))
        elif tier not in dict(self.calibration.load_fits):
            out.append(Option(SessionMode.PERSIST, 0.0, 0, math.inf, EXACT, False,
                              f"no load measurements for tier {tier!r}"))
        else:
            out.append(Option(SessionMode.PERSIST, 0.0, 0, self.predict_load(tier, need), EXACT, True,
                              f"{need} B window from {tier}"))
        replay_ok = can_replay and bool(self.calibration.replay_points)
        no_replay = "no replay model" if not can_replay else "no replay measurements"
        r = self.replay_length(context, self.exact_bound)
        out.append(Option(SessionMode.EXACT, 0.0, r, self.predict_replay(context, r) if replay_ok else math.inf,
                          EXACT, replay_ok, f"replays {r} tokens" if replay_ok else no_replay))
        w = self.calibration.model.window
        for k in self.approx_ks():
            r = self.replay_length(context, math.ceil(k * w))  # as the replay computes it
            fid = self.fidelity(r, context)
            ok = replay_ok and floor.allows(fid)
            measured = f"top1 {fid.top1:.4g}, KL {fid.kl:.3g}, kv error {fid.kv_rel_error:.3g}"
            why = (no_replay if not replay_ok else f"replays {r} tokens ({measured})" if ok
                   else f"{measured}: below the floor")
            out.append(Option(SessionMode.APPROX, k, r, self.predict_replay(context, r) if replay_ok else math.inf,
                              fid, ok, why))
        return out

    def choose(self, context: int, *, budget_bytes: int, floor: FidelityFloor = FidelityFloor(),
               tier: str = "dram", window_bytes: int | None = None, can_replay: bool = True) -> Choice:
        """The fastest option allowed by the budget and the floor (ties: exact before approx, replay before
        persist, which spends storage). Raises NoAllowedOption, listing why each was refused, when none is."""
        opts = self.options(context, budget_bytes=budget_bytes, floor=floor, tier=tier,
                            window_bytes=window_bytes, can_replay=can_replay)
        allowed = [o for o in opts if o.allowed]
        if not allowed:
            raise NoAllowedOption(opts)
        rank = {SessionMode.EXACT: 0, SessionMode.PERSIST: 1, SessionMode.APPROX: 2}
        best = min(allowed, key=lambda o: (o.predicted_s, rank[o.mode], -o.approx_k))
        others = ", ".join(f"{_name(o)} {_ms(o.predicted_s)}" if o.allowed else f"{_name(o)} refused ({o.why})"
                           for o in opts if o is not best)
        reason = f"{_name(best)}: {best.why}, predicted {_ms(best.predicted_s)}, the fastest allowed"
        return Choice(best.mode, best.approx_k, best.predicted_s, reason + (f" (others: {others})" if others else ""))


# ---- prediction accuracy -------------------------------------------------------------------------------


class Accuracy(NamedTuple):
    what: str
    measured: float
    predicted: float
    ratio: float  # predicted / measured (inf where measured is 0 and predicted is not)


def report(calibration: Calibration, bench_json: Mapping[str, Any] | str | Path) -> list[Accuracy]:
    """Predict every replay and load point of a benchmark run (the same schema; another run, or the calibration's
    own) with the calibration, so the benchmark can state "predicted within X%": max |ratio - 1|."""
    bench = (Calibration.from_file(bench_json) if isinstance(bench_json, str | Path)
             else Calibration.from_json(bench_json, "<bench>"))
    cm = CostModel(calibration)

    def row(what: str, measured: float, predict: Callable[[], float]) -> Accuracy:
        try:
            predicted = predict()
        except ValueError:  # nothing calibrated for it (a tier, or replay at all): NaN, not a crash mid-report
            return Accuracy(what, measured, math.nan, math.nan)
        ratio = predicted / measured if measured > 0 else (1.0 if predicted == 0 else math.inf)
        return Accuracy(what, measured, predicted, ratio)

    rows = [row(f"replay P={p.context} R={p.replayed} ({p.label})", p.seconds,
                partial(cm.predict_replay, p.context, p.replayed)) for p in bench.replay_points]
    rows += [row(f"load {q.tier} {q.bytes} B", q.seconds, partial(cm.predict_load, q.tier, q.bytes))
             for q in bench.load_points]
    return rows


# ---- the policy against measurements ---------------------------------------------------------------------


class PolicyCheck(NamedTuple):
    context: int
    budget_bytes: int
    chosen: str  # "persist", "exact" or "approx k=2"
    chosen_s: float  # what the chosen option measured in the run
    best: str  # the fastest option the run measured among those the budget and floor allowed
    best_s: float
    ratio: float  # chosen_s / best_s: the target is <= 1.2


def policy_check(calibration: Calibration, bench_json: Mapping[str, Any] | str | Path, budgets: Sequence[int],
                 floor: FidelityFloor | None = None, tier: str = "dram") -> list[PolicyCheck]:
    """For each context of a run and each budget, the option the calibrated model chooses against the options
    the run measured: allowed by the run's own fidelity and window sizes, timed by its own points (a load at
    the window's size: the nearest measured size of `tier`). Contexts whose options the run did not all time
    are left out."""
    floor = floor or FidelityFloor()
    bench = (Calibration.from_file(bench_json) if isinstance(bench_json, str | Path)
             else Calibration.from_json(bench_json, "<bench>"))
    chooser, measured = CostModel(calibration), CostModel(bench)
    loads = sorted((q.bytes, q.seconds) for q in bench.load_points if q.tier == tier)
    out = []
    for context in sorted({p.context for p in bench.replay_points}):
        timed = {p.replayed: p.seconds for p in bench.replay_points if p.context == context}
        for budget in budgets:
            opts = measured.options(context, budget_bytes=budget, floor=floor, tier=tier)
            times: dict[tuple[SessionMode, float], float] = {}
            for o in opts:
                if o.mode == SessionMode.PERSIST:
                    need = measured.window_bytes(context)
                    if loads and need is not None:
                        gaps = [abs(size - need) for size, _ in loads]
                        times[(o.mode, 0.0)] = loads[gaps.index(min(gaps))][1]
                elif o.replayed in timed:
                    times[(o.mode, o.approx_k)] = timed[o.replayed]
            allowed = [o for o in opts if o.allowed]
            if not allowed or any((o.mode, o.approx_k) not in times for o in allowed):
                continue
            try:
                choice = chooser.choose(context, budget_bytes=budget, floor=floor, tier=tier)
            except NoAllowedOption:
                continue
            best = min(allowed, key=lambda o: times[(o.mode, o.approx_k)])
            chosen_s = times.get((choice.mode, choice.approx_k), math.inf)
            best_s = times[(best.mode, best.approx_k)]
            out.append(PolicyCheck(context, budget, _label(choice.mode, choice.approx_k), chosen_s,
                                   _label(best.mode, best.approx_k), best_s,
                                   chosen_s / best_s if best_s > 0 else math.inf))
    return out


def _label(mode: SessionMode, k: float) -> str:
    return f"approx k={k:g}" if mode == SessionMode.APPROX else str(mode.value)
