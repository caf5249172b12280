"""`engram stats`: the daemon's tiers, models and counters, as a Rich table or JSON."""

from __future__ import annotations

import json
from typing import Any

from rich.console import Group
from rich.table import Table

from engram.api import ReplayStats, Stats

from .format import to_dict


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def stats_dict(resp: Stats) -> dict[str, Any]:
    d: dict[str, Any] = to_dict(resp)
    return d


def stats_json(resp: Stats) -> str:
    return json.dumps(stats_dict(resp), indent=2, sort_keys=True)


ADMIN_ONLY = "admin only"


def admin(resp: Stats, text: str) -> str:
    """`text`, or "admin only" in a tenant's Stats, which leaves out (as 0) the daemon-wide activity figures."""
    return ADMIN_ONLY if resp.scoped else text


def session_tokens_line(rp: ReplayStats, mine: bool) -> str:
    """The tokens live sessions hold against the bound on them (a tenant's: its share)."""
    bound = rp.session_tokens_bound
    if not bound:
        return f"{rp.session_tokens} ({'no share' if mine else 'no bound'})"
    return f"{rp.session_tokens} of {bound} ({100.0 * rp.session_tokens / bound:.0f}%)"


def stats_renderable(resp: Stats) -> Group:
    mine = resp.scoped  # a tenant: tiers hold its own copies, their counters are the admin's
    tiers = Table(title=("tiers (your namespaces' copies, a shared one's at their homes; hits, evictions and moves: "
                         "admin only)") if mine else "tiers",
                  title_justify="left")
    columns = ["tier", "state", "used", "capacity", "blocks", "tokens", "bytes/token", "pinned"]
    if not mine:
        columns += ["hits", "misses", "hit ratio", "evictions", "demoted", "promoted"]
    for col in columns:
        tiers.add_column(col, justify="left" if col in ("tier", "state") else "right")
    for t in resp.tiers:
        pct = 100.0 * t.used_bytes / t.capacity_bytes if t.capacity_bytes else 0.0
        reads = t.hits + t.misses
        row = [t.name, t.state + (f" ({t.state_reason})" if t.state_reason else ""),
               f"{human_bytes(t.used_bytes)} ({pct:.0f}%)", human_bytes(t.capacity_bytes), str(t.blocks),
               str(t.tokens), f"{t.used_bytes / t.tokens:.0f}" if t.tokens else "-", str(t.pinned_blocks)]
        if not mine:
            row += [str(t.hits), str(t.misses), f"{100.0 * t.hits / reads:.1f}%" if reads else "-", str(t.evictions),
                    f"{t.demotions} ({human_bytes(t.demoted_bytes)})",
                    f"{t.promotions} ({human_bytes(t.promoted_bytes)})"]
        tiers.add_row(*row)
    models = Table(title="models", title_justify="left")
    for col in ("model", "fingerprint", "codec", "blocks", "tokens", "stored", "bytes/token", "raw bytes/token"):
        models.add_column(col, justify="left" if col in ("model", "fingerprint", "codec") else "right")
    for m in resp.models:
        per_tok = f"{m.stored_bytes / m.tokens:.0f}" if m.tokens else "-"
        raw_tok = f"{m.raw_bytes / m.tokens:.0f}" if m.tokens else "-"
        models.add_row(m.name, m.model_fingerprint.hex()[:12], m.codec, str(m.blocks), str(m.tokens),
                       human_bytes(m.stored_bytes), per_tok, raw_tok)
    rp = resp.replay
    stored = sum(m.stored_bytes for m in resp.models)
    every = sum(m.all_layers_bytes for m in resp.models)
    replay = Table(title="sessions and replay", title_justify="left", show_header=False)
    replay.add_column("name")
    replay.add_column("value", justify="right")
    for name, value in (
        ("sessions (hot)", f"{rp.sessions} ({rp.hot_sessions})"),
        ("session tokens held" + (" (your token's)" if mine else ""), session_tokens_line(rp, mine)),
        ("persisted bytes, with replay", f"{human_bytes(stored + rp.persisted_window_bytes)}"),
        ("persisted bytes, every layer kept (raw)", human_bytes(every)),
        ("replays", admin(resp, f"{rp.replays} ({rp.replayed_tokens} tokens, {rp.replay_seconds * 1000:.0f} ms)")),
        ("windows dropped as their blocks left memory", admin(resp, str(rp.windows_dropped_cold))),
    ):
        replay.add_row(name, value)
    looked = resp.lookup_hit_tokens + resp.lookup_miss_tokens
    hit_pct = 100.0 * resp.lookup_hit_tokens / looked if looked else 0.0
    yours = " (your namespaces')" if mine else ""
    counters = Table(title="counters", title_justify="left", show_header=False)
    counters.add_column("name")
    counters.add_column("value", justify="right")
    for name, value in (
        ("lookups", admin(resp, str(resp.lookups))),
        ("token hit ratio", admin(resp, f"{hit_pct:.1f}% ({resp.lookup_hit_tokens} of {looked})")),
        ("blocks put" + yours, str(resp.blocks_put)),
        ("blocks deduplicated" + yours, str(resp.blocks_deduplicated)),
        ("blocks served" + yours, str(resp.blocks_served)),
        ("blocks prefetched", admin(resp, str(resp.blocks_prefetched))),
        ("sessions closed idle", admin(resp, str(resp.sessions_closed_idle))),
        ("blocks evicted on request", admin(resp, str(resp.blocks_evicted_on_request))),
        ("blocks acknowledged not durable", admin(resp, str(resp.blocks_not_durable))),
        ("corrupt blocks found", admin(resp, str(resp.corrupt_blocks))),
        ("bytes served" + yours, human_bytes(resp.bytes_served)),
        ("default codec", f"{resp.default_codec} ({resp.default_codec_reason}); encoded here by {resp.codec_backend}"),
        ("eviction order", admin(resp, eviction_line(resp))),
        ("uptime", f"{resp.uptime_s:.1f} s"),
        ("version", resp.version),
    ):
        counters.add_row(name, value)
    parts = [tiers, models, replay, counters]
    if resp.codec_errors or resp.codec_fallbacks:
        parts.append(codec_error_table(resp))
    c = resp.cluster
    if c.state != "off":  # a daemon with a cluster tier: its node, peers and what crossed between them
        cluster = Table(title="cluster", title_justify="left", show_header=False)
        cluster.add_column("name")
        cluster.add_column("value", justify="right")
        for name, value in (
            ("state", c.state + (f" ({c.reason})" if c.reason else "")),
            ("node", c.node_id),
            ("live nodes", str(c.live_nodes)),
            ("blocks fetched from peers", admin(resp, f"{c.remote_hits} ({human_bytes(c.remote_bytes)})")),
            ("peer fetches failed", admin(resp, str(c.remote_failures))),
            ("blocks published", admin(resp, str(c.published))),
            ("rejoins", admin(resp, str(max(0, c.reconnects - 1)))),
            ("untrusted records ignored", admin(resp, str(c.untrusted_records))),
            ("stale holder entries removed", admin(resp, str(c.stale_entries_removed))),
        ):
            cluster.add_row(name, value)
        parts.append(cluster)
    return Group(*parts)


def eviction_line(resp: Stats) -> str:
    """Which order picks victims within a held class (engram/eviction.py), and what it has learned from."""
    e = resp.eviction
    seen = f"{e.comebacks} comebacks seen, {e.ghosts} deleted blocks remembered"
    if not e.learned:
        return f"least recently used (learning: {seen})"
    return f"{e.orders()} ({seen})"


def codec_error_table(resp: Stats) -> Table:
    """The sampled error of blocks the daemon encoded, per codec, tier (first written), layer kind and part, and
    the (codec, layer kind) pairs stored lossless since they passed codec.max_error."""
    sampled = admin(resp, f"{resp.codec_error_blocks} blocks, {resp.codec_error_skipped} skipped")
    table = Table(title=f"codec error (sampled: {sampled}; rel = ||x - dq|| / ||x||, max abs = max|x - dq| / "
                        "max|x|, per layer)",
                  title_justify="left")
    for col in ("codec", "tier", "layer kind", "part", "layers", "rel mean", "rel max", "max abs mean",
                "max abs max", "fallback"):
        table.add_column(col, justify="left" if col in ("codec", "tier", "layer kind", "part", "fallback")
                         else "right")
    falls = {(f.codec, f.layer_kind): f for f in resp.codec_fallbacks}
    for e in resp.codec_errors:
        f = falls.get((e.codec, e.layer_kind))
        table.add_row(e.codec, e.tier, e.layer_kind, e.part, str(e.samples), f"{e.rel_mean:.4f}", f"{e.rel_max:.4f}",
                      f"{e.max_abs_mean:.4f}", f"{e.max_abs_max:.4f}",
                      f"raw since {f.rel_mean:.4f} > {f.max_error:g} ({f.blocks} blocks)" if f else "-")
    return table
