"""``docs/benchmarks-scale.md`` and its plot, from ``benchmarks-scale.json`` (bench/scale.py).

``docs/benchmarks.md`` embeds this page (:func:`bench.report.write`), so either
generator leaves both pages current.
"""

# ruff: noqa: RUF001 - the pages use en dashes and multiplication signs

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from elasticrun.api import crd, rounds, slices
from elasticrun.api.model import RunSpec
from elasticrun.api.rounds import DEFER_SEAL_FROM, QUIET_WATCH_FROM, TELL_IN_SLICES_FROM

from bench.stats import growth_exponent, summary

PAGE = "benchmarks-scale.md"
PLOT = "bench-scale.png"
#: The sizes the issue's exponents are fitted over.
FIT_FROM, FIT_TO = 64, 2048
TARGET_EXPONENT = 1.2


def _ratio(ours: float | None, floor: float | None) -> str:
    return f"{ours / floor:.2f}×" if ours and floor else "–"


def _floor_rounds(rows: list[dict[str, Any]]) -> str:
    """How many floor rounds each N's times come from (``floor_reps``; one in rows without it,
    which :func:`bench.scale.floor_fields` did not write)."""
    reps = sorted({int(r.get("floor_reps", 1)) for r in rows})
    if reps == [1]:
        return "one round per N"
    counts = str(reps[0]) if len(reps) == 1 else f"{reps[0]}–{reps[-1]}"
    return (f"the median of {counts} rounds per N, each phase over the rounds that timed it "
            "(`scale.floor_fields`)")


def _floor_table(mixed: list[dict[str, Any]]) -> list[str]:
    """The floor (:mod:`bench.floor`) measured right after each mixed round, and ours over it."""
    rows = [r for r in mixed if "floor_s" in r]
    if not rows:
        return []
    lines = ["", "### Against the floor", "",
             "The cheapest rendezvous this API server allows, measured right after each "
             f"mixed round on the same server (`bench/floor.py`; {_floor_rounds(rows)}): "
             "N clients each create "
             "their own Lease once and wait for one watch event of one ConfigMap, which "
             "a single writer updates once after its Lease watch has shown all N; a loss "
             "(one Lease deleted) and a newcomer (one more created) are one more update "
             "each. Times run until the last client knew. Our loss: one simulated member "
             "(never rank 0) of the round the newcomer joined loses its Lease and its "
             "departure is written (`scale.lose_member`, a handler's `shutdown()`), timed "
             "until every survivor's `num_nodes_waiting()` is positive (simulated members: "
             "their run watch; real handlers: polled).", "",
             "Our newcomer: once the round of N formed, one more real handler calls "
             "`next_rendezvous()`; timed until every member and the newcomer hold the next "
             "round of N + 1 (real handlers: `next_rendezvous()` returned; simulated members: "
             "their run watch or their slice showed their place). The run is created with "
             "`minNodes = N`, `maxNodes = N + 1` and `lastCallTimeoutSeconds = 0` (the first "
             "round seals at its N-th request); before the newcomer asks, its last call "
             "becomes as long as the phase's bound (`scale.newcomer_timing`), so that the "
             "members keep their places while they come back (with none, the newcomer and "
             "N − 1 members back seal a round of N without the last one). No owner sets a "
             "target (`status.desired`), so by design the newcomer's round "
             "waits on no last call: `rounds.announce_due` holds no newcomer back (it would, "
             "with a target, until members + newcomers reach it or the last call passes), "
             "the newcomer's own request tells the members (`joinNotice` moves the signal), "
             "each member comes back as soon as its `num_nodes_waiting()` is positive (real "
             "handlers ask it whenever their cache changes, torch's agent every 100 ms), and "
             "the round seals the moment every member is back (`rounds.decide_seal`'s first "
             f"rule): from N = {DEFER_SEAL_FROM} to {TELL_IN_SLICES_FROM - 1:,} the operator "
             "seals the newcomer's round as soon as its request is in, keeping every "
             "member's place and rank 0's at the next round's store it announced "
             "(`rounds.members_keep_places`: no notice, no member writes; from "
             f"N = {QUIET_WATCH_FROM} a member woken by its quiet watch reads the run once "
             "and finds its place there); elsewhere each asks again. The "
             "floor's newcomer joins after its loss (N − 1 + 1); ours joins a round of N. "
             f"At N = {crd.spec_maximum('maxNodes'):,}, the CRD's largest `maxNodes`, a round "
             "has no room for a newcomer: no newcomer there, and the loss is in the round "
             "of N.",
             "",
             "| N | formation (ours) | formation (floor) | ours / floor | newcomer (ours) "
             "| newcomer (floor) | ours / floor | loss (ours) | loss (floor) | ours / floor |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ours = r["latency_s"] if r.get("formed") else None
        joined, loss = r.get("newcomer_s"), r.get("loss_s")
        lines.append(f"| {r['n']:,} | {_s(ours)} | {_s(r['floor_s'], 3)} | "
                     f"{_ratio(ours, r['floor_s'])} | {_s(joined, 3)} | "
                     f"{_s(r.get('floor_newcomer_s'), 3)} | "
                     f"{_ratio(joined, r.get('floor_newcomer_s'))} | {_s(loss, 3)} | "
                     f"{_s(r.get('floor_loss_s'), 3)} | {_ratio(loss, r.get('floor_loss_s'))} |")
    return lines


def _frozen_table(frozen: list[dict[str, Any]]) -> list[str]:
    """A member that stops renewing: its removal against the heartbeat, the survivors' round."""
    if not frozen:
        return []
    heartbeat, renew = frozen[0]["heartbeat_s"], frozen[0]["renew_s"]
    lines = ["### Frozen member", "",
             "A formed round of N simulated nodes (`scale.frozen_round`); one member (never "
             "rank 0) stops renewing its Lease and watching, without deleting its Lease or "
             "leaving. *Removed*: from its last renewal until the operator removed it "
             "(the time it recorded in `status.lostMembers`), against the run's heartbeat. "
             "*Survivors' round*: from that removal until every survivor holds the next round "
             "(each asks again as soon as its run watch shows the loss: at this heartbeat, "
             "two renewals, no place is kept, `rounds.members_keep_places`; "
             "`minNodes = N − 1`). "
             f"The heartbeat is kept short for the benchmark: the CRD's shortest, {heartbeat} s, "
             f"with renewals every {renew} s (its shortest interval, which the heartbeat must "
             "exceed); "
             "the operator counts a renewal when it sees the Lease change, so *removed* is "
             "at least the heartbeat, and *beyond it* is the operator's reaction. Simulated "
             "nodes leave the seal to the operator, as real ones do from "
             f"`maxNodes = {DEFER_SEAL_FROM}` on; below that the operator first gives the "
             "nodes a grace of 1 s to seal themselves (`SEAL_GRACE`), which simulated nodes "
             "never use, so a smaller N here shows that second. Target (issue 36): the "
             "survivors' round within 1 s of the removal.", "",
             "| N | heartbeat | removed | beyond the heartbeat | survivors told "
             "| survivors' round | within 1 s | round of |",
             "|---|---|---|---|---|---|---|---|"]
    for r in frozen:
        removed, follow = r.get("removed_s"), r.get("survivors_round_s")
        beyond = None if removed is None else removed - r["heartbeat_s"]
        quick = "–" if follow is None else ("met" if follow <= 1 else "missed")
        worlds = ", ".join(str(w) for w in r.get("survivors_worlds") or []) or "–"
        lines.append(f"| {r['n']:,} | {r['heartbeat_s']} s | {_s(removed, 3)} | {_s(beyond, 3)} | "
                     f"{_s(r.get('told_s'), 3)} | {_s(follow, 3)} | {quick} | {worlds} |")
    return lines


def _ways(max_nodes: int) -> str:
    """How a run of ``max_nodes`` tells its members their places and their round's news,
    by the rules the handler and the operator follow (:mod:`elasticrun.api.rounds`)."""
    spec = RunSpec(min_nodes=1, max_nodes=max_nodes)
    if rounds.members_told_in_slices(spec):
        return "places in slices, news by the quiet watch"
    if rounds.members_watch_quietly(spec):
        return "places by the seal's broadcast, news by the quiet watch"
    return "places and news by the full watch"


def slice_writes(by_kind: dict[str, int]) -> int:
    """The writes of ``ElasticRunSlice`` objects among a window's requests by kind (the
    audit log's ``verb resource``; failed ones, ``... -> code``, are not writes)."""
    verbs = ("create", "update", "patch", "delete")
    return sum(count for kind, count in by_kind.items()
               if kind in {f"{verb} {crd.SLICE_PLURAL}" for verb in verbs})


def _regimes_table(regimes: list[dict[str, Any]]) -> list[str]:
    """The large runs' ways of telling their members, run at a small N (``--quick``)."""
    if not regimes:
        return []
    lines = ["### Large runs' ways at a small N", "",
             "A mixed round of the smallest N in a run of each `maxNodes` (`scale.regimes`): "
             "how a run tells its members depends on its `maxNodes`, not on how many nodes "
             "came, so these rounds take the large runs' ways at a small N. *Operator slice "
             "writes*: writes of `elasticrunslices` in the formation, which only the operator "
             f"makes (at most {slices.SLICE_COUNT} a round, where places are told in "
             "slices).", "",
             "| N | maxNodes | members told | formation | newcomer | loss "
             "| operator slice writes |",
             "|---|---|---|---|---|---|---|"]
    for r in regimes:
        told = slice_writes(r.get("by_kind", {}))
        lines.append(f"| {r['n']:,} | {r['max_nodes']:,} | {_ways(r['max_nodes'])} | "
                     f"{_s(r.get('latency_s'))} | {_s(r.get('newcomer_s'), 3)} | "
                     f"{_s(r.get('loss_s'), 3)} | {told:,} |")
    return lines


def _s(value: float | None, digits: int = 2) -> str:
    if value is None:
        return "–"
    return f"{value:.{digits}f} s" if value < 100 else f"{value:.0f} s"


def _num(value: float | None) -> str:
    return "–" if value is None else f"{value:,.0f}"


def _size(value: float | None) -> str:
    if value is None:
        return "–"
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if value >= scale:
            return f"{value / scale:.1f} {unit}"
    return f"{value:.0f} B"


def _median(rows: list[dict[str, Any]], key: str) -> dict[int, float]:
    by_n: dict[int, list[float | None]] = {}
    for row in rows:
        if row.get("formed"):
            by_n.setdefault(int(row["n"]), []).append(row.get(key))
    medians = {n: s["median"] for n, values in by_n.items() if (s := summary(values))}
    return medians


def _fit(rows: list[dict[str, Any]], key: str, start: int = FIT_FROM,
         end: int = FIT_TO) -> float | None:
    points = {n: v for n, v in _median(rows, key).items() if start <= n <= end}
    sizes = sorted(points)
    return growth_exponent([float(n) for n in sizes], [points[n] for n in sizes])


def _exp(value: float | None) -> str:
    return "–" if value is None else f"N^{value:.2f}"


def _formation_rows(data: dict[str, Any]) -> tuple[list[str], dict[str, Any]]:
    """The real-handler table: k8s and c10d, as-is and DNS-neutral, with construction."""
    rows = [*data.get("real", []), *data.get("c10d", [])]
    sizes = sorted({int(r["n"]) for r in rows})
    cols = [(b, d) for b in ("k8s", "c10d") for d in ("as-is", "neutral")]

    def pick(backend: str, dns: str, n: int) -> list[dict[str, Any]]:
        return [r for r in rows if r["backend"] == backend and r["dns"] == dns and r["n"] == n]

    def cell(backend: str, dns: str, n: int, key: str) -> float | None:
        got = [r.get(key) for r in pick(backend, dns, n) if r.get("formed")]
        s = summary(got)
        return s["median"] if s else None

    def failed(backend: str, dns: str, n: int) -> str:
        tried = pick(backend, dns, n)
        bad = [r for r in tried if not r.get("formed")]
        return f"not formed in {bad[0]['bound_s']:.0f} s" if bad and len(bad) == len(tried) \
            else "–"

    lines = ["| N | k8s as-is | incl. construction | k8s DNS-neutral | incl. construction "
             "| c10d as-is | incl. construction | c10d DNS-neutral | incl. construction "
             "| k8s / c10d as-is | k8s / c10d DNS-neutral |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    facts: dict[str, Any] = {"ratios": {}}
    for n in sizes:
        values = {c: cell(*c, n, "latency_s") for c in cols}
        built = {c: cell(*c, n, "build_s") for c in cols}
        with_build: dict[tuple[str, str], float | None] = {}
        for c in cols:
            value, build = values[c], built[c]
            with_build[c] = value + build if value is not None and build is not None else None

        def show(c: tuple[str, str], v: dict[tuple[str, str], float | None],
                 n: int = n) -> str:
            return _s(v[c]) if v[c] is not None else failed(*c, n)

        ratio: dict[str, float | None] = {}
        for dns in ("as-is", "neutral"):
            ours, theirs = values[("k8s", dns)], values[("c10d", dns)]
            ratio[dns] = ours / theirs if ours is not None and theirs else None
        facts["ratios"][n] = ratio
        facts.setdefault("k8s_neutral", {})[n] = values[("k8s", "neutral")]
        facts.setdefault("k8s_asis", {})[n] = values[("k8s", "as-is")]
        lines.append(
            f"| {n} | " + " | ".join(f"{show(c, values)} | {show(c, with_build)}" for c in cols)
            + " | " + " | ".join("–" if ratio[d] is None else f"{ratio[d]:.2f}×"
                                 for d in ("as-is", "neutral")) + " |")
    return lines, facts


def _targets(data: dict[str, Any], facts: dict[str, Any]) -> list[str]:
    mixed = data.get("mixed", [])
    by_n = {int(r["n"]): r for r in mixed}
    lines = ["| target | result |", "|---|---|"]
    neutral, asis = facts.get("k8s_neutral", {}), facts.get("k8s_asis", {})
    if 256 in neutral or 256 in asis:
        v = neutral.get(256)
        verdict = "–" if v is None else ("met" if v <= 5 else "missed")
        lines.append(f"| formation of 256 real handlers ≤ 5 s | {verdict}: {_s(v)} DNS-neutral "
                     f"(as-is: {_s(asis.get(256))}; the difference is this machine's resolver) |")
    ratios = facts.get("ratios", {})
    if ratios:
        worst = {d: max((r[d] for r in ratios.values() if r[d] is not None), default=None)
                 for d in ("neutral", "as-is")}
        w = worst["neutral"]
        lines.append("| k8s / c10d ≤ 0.5 wherever c10d completes | "
                     + ("–" if w is None else ("met" if w <= 0.5 else "missed")
                        + f": worst {w:.2f}× DNS-neutral") + " (as-is: "
                     + ("–" if worst["as-is"] is None else f"worst {worst['as-is']:.2f}×")
                     + ") |")
    for n, bound in ((1024, 10.0), (2048, None)):
        row = by_n.get(n)
        if row is None:
            lines.append(f"| {n:,} simulated nodes formed | not reached in this run |")
            continue
        latency = row.get("latency_s")
        verdict = "missed" if latency is None else (
            "met" if bound is None or latency <= bound else "missed")
        what = f"≤ {bound:.0f} s" if bound else "measured"
        lines.append(f"| {n:,} nodes ({row['simulated']:,} simulated + {row['real']} real) "
                     f"formed, {what} | {verdict}: {_s(latency)} |")
    for key, label in (("requests", "requests"), ("bytes_sent", "bytes sent"),
                       ("server_cpu_s", "API server + etcd CPU")):
        k = _fit(mixed, key)
        lines.append(f"| {label} per round ≤ N^{TARGET_EXPONENT} over {FIT_FROM}…{FIT_TO:,} | "
                     + ("–" if k is None else ("met" if k <= TARGET_EXPONENT else "missed")
                        + f": {_exp(k)}") + " |")
    over = [r for r in mixed if r.get("formed") and r["writes"] > 2 * r["n"] + 5]
    lines.append("| writes ≤ 2N + 5 per round | " + (
        "met at every N" if not over else
        "missed at N = " + ", ".join(str(r["n"]) for r in over)) + " |")
    largest = max((r for r in mixed if r.get("object_bytes")), key=lambda r: r["n"],
                  default=None)
    if largest is not None:
        lines.append(f"| ElasticRun far below etcd's 1.5 MiB request limit | at N = "
                     f"{largest['n']:,}: {_size(largest['object_bytes'])} "
                     f"({largest['object_bytes'] / 1.5 / 2**20:.0%} of the limit), "
                     f"{largest['managed_fields_entries']} managedFields entries "
                     f"({', '.join(largest['field_managers'])}) |")
    return lines


def _before_after(data: dict[str, Any]) -> list[str]:
    """The protocol before this one against this one, real handlers, DNS-neutral."""
    before = [r for r in data.get("baseline") or [] if r.get("formed")]
    if not before:
        return []
    rev = before[0]["rev"]
    now = [r for r in data.get("real", []) if r["dns"] == "neutral" and r.get("formed")]
    lines = [f"## Where the time and the bytes went: before (`{rev}`) and now", "",
             f"Real handlers, DNS-neutral, with the operator running, the same harness; `{rev}` "
             "is taken from git with its own CRD. Bytes: the API server's responses plus its "
             "watch events for the run's ElasticRun and Leases; client CPU: all handler "
             "processes.", "",
             "| N | protocol | formation | requests | `list leases` | `get elasticruns` "
             "| response bytes | watch bytes | server CPU | client CPU / node |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for n in sorted({int(r["n"]) for r in before}):
        for label, rows in ((f"before (`{rev}`)", before), ("now", now)):
            got = [r for r in rows if r["n"] == n]
            if not got:
                continue
            r = got[0]
            kinds = r.get("by_kind", {})
            lines.append(
                f"| {n} | {label} | {_s(r['latency_s'])} | {_num(r['requests'])} | "
                f"{_num(kinds.get('list leases', 0))} | {_num(kinds.get('get elasticruns', 0))} "
                f"| {_size(r.get('response_bytes'))} | {_size(r['watch_bytes'])} | "
                f"{_s(r['server_cpu_s'])} | {r['client_cpu_s'] / n * 1e3:.1f} ms |")
    return [*lines, ""]


def _plot(data: dict[str, Any], out: Path) -> str | None:
    mixed = [r for r in data.get("mixed", []) if r.get("formed")]
    if len(mixed) < 2:
        return None
    import matplotlib  # noqa: PLC0415 - only the report needs it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    xs = [r["n"] for r in mixed]
    fig, (left, right) = plt.subplots(1, 2, figsize=(9.6, 3.8))
    for key, label in (("requests", "requests"), ("bytes_sent", "bytes sent / 1,000"),
                       ("server_cpu_s", "server CPU (ms)")):
        scale = {"bytes_sent": 1e-3, "server_cpu_s": 1e3}.get(key, 1.0)
        left.plot(xs, [r[key] * scale for r in mixed], marker="o", label=label)
    base = mixed[0]["requests"]
    left.plot(xs, [base * n / xs[0] for n in xs], linestyle=":", color="grey", label="∝ N")
    left.set(xscale="log", yscale="log", xlabel="nodes N", title="Server work per round")
    left.grid(True, which="both", alpha=0.3)
    left.legend(fontsize=8)
    right.plot(xs, [r["latency_s"] for r in mixed], marker="o", label="k8s, mixed round")
    for backend, dns in (("k8s", "neutral"), ("c10d", "neutral"), ("c10d", "as-is")):
        got = _median([r for r in [*data.get("real", []), *data.get("c10d", [])]
                       if r["backend"] == backend and r["dns"] == dns], "latency_s")
        if got:
            ns = sorted(got)
            right.plot(ns, [got[n] for n in ns], marker="s",
                       label=f"{backend}, all real, DNS {dns}")
    right.set(xscale="log", yscale="log", xlabel="nodes N", ylabel="seconds",
              title="Formation latency")
    right.grid(True, which="both", alpha=0.3)
    right.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / PLOT, dpi=80)
    plt.close(fig)
    return PLOT


def render(data: dict[str, Any], plot: str | None) -> str:
    m, plan = data["machine"], data["plan"]
    loads = data.get("load", {})
    formation_lines, facts = _formation_rows(data)
    lines = [
        "# Scale: rounds of 64 to 2,048 nodes", "",
        f"Generated by `bench/scale.py`; do not edit by hand. Re-run with `{data['command']}` "
        f"(the whole run took {data['seconds'] / 60:.1f} min).", "",
        f"* Machine: {m['nproc']} cores ({m['cpu']}), {m['memory_gib']} GiB; measured "
        f"{data['started']} at commit `{data.get('commit', 'unknown')}`, with the operator "
        "running (large runs leave the seal to it).",
        "* 1-minute load average after each part (the benchmark alone keeps it near "
        f"{m['nproc']}): " + ", ".join(f"{k} {v}" for k, v in loads.items()) + ".",
        f"* Mixed rounds: N nodes, of which {plan['sample']} are real handlers (threads in "
        f"{plan['workers']} bench workers) and the rest simulated nodes in "
        f"{plan['sim_processes']} asyncio processes (`bench/simnode.py`: the handler's own "
        "request bodies, one request and one watch connection per node, from "
        f"{QUIET_WATCH_FROM} nodes the quiet watch of its round once it holds one, and from "
        f"{TELL_IN_SLICES_FROM:,} nodes a second watch, of its slice by name; placed in a round "
        "it does not lead, one read of its rank 0's Lease, as a handler checks the round's "
        "store against it before connecting). The real handlers "
        "join 1.5 s ahead, so that rank 0, whose TCPStore every real handler reaches, is one "
        "of them; formation counts from the simulated nodes' start, the last N − "
        f"{plan['sample']} arriving at once. One repetition per N; "
        "`minNodes = N`, `maxNodes = N + 1` (room for the newcomer) and no last call, so "
        "the N-th request seals the round as `maxNodes = N` would.",
        f"* Real rounds: every node a real handler, {plan['reps']} repetitions, median. "
        "*DNS-neutral*: every worker process loads `bench/dnsshim.py`'s `getnameinfo()` "
        "(numeric hosts only, built with gcc into `~/.cache/elasticrun/`), for k8s and c10d "
        "alike. *Incl. construction*: plus the time to build the N handlers (c10d connects "
        "to its store there, outside the formation clock).", ""]
    if data.get("quick"):
        lines += ["> **Quick mode**: small N, one repetition; shows that the harness works.",
                  ""]
    if data.get("errors"):
        lines += ["**Errors during this run:**", ""] + [f"* {e}" for e in data["errors"]] + [""]
    lines += ["## Targets (the protocol's figures; the environment's effect beside them)", ""]
    lines += [*_targets(data, facts), ""]
    mixed = data.get("mixed", [])
    lines += ["## Server work per round (mixed rounds)", "",
              "From the API server: requests on the run's ElasticRun, slices and Leases from its "
              "audit log (Lease renewals apart), bytes of its responses "
              "(`apiserver_response_sizes`) plus watch events "
              "(`apiserver_watch_events_sizes`) for `elasticrun.dev` and "
              "`coordination.k8s.io`, CPU of kube-apiserver + etcd; the operator's CPU beside "
              "it. Object: the ElasticRun as stored after the round formed.", "",
              "| N | real + simulated | formation | first node | requests | writes | 2N+5 "
              "| bytes sent | bytes / node | server CPU | operator CPU | object | "
              "managedFields |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in mixed:
        lines.append(
            f"| {r['n']:,} | {r['real']} + {r['simulated']:,} | "
            + (_s(r['latency_s']) if r.get("formed") else "not formed: "
               + "; ".join(r.get("errors") or ["bound"])) + " | "
            f"{_s(r.get('first_done_s'))} | {_num(r['requests'])} | {_num(r['writes'])} | "
            f"{2 * r['n'] + 5:,} | {_size(r['bytes_sent'])} | "
            f"{_size(r['bytes_sent'] / r['n'])} | {_s(r['server_cpu_s'])} | "
            f"{_s(r['operator_cpu_s'])} | {_size(r.get('object_bytes'))} | "
            f"{r.get('managed_fields_entries', '–')} |")
    lines += _floor_table(mixed)
    fitted = {"requests": "requests", "writes": "writes", "bytes_sent": "bytes sent",
              "response_bytes": "response bytes", "watch_bytes": "watch bytes",
              "server_cpu_s": "server CPU", "operator_cpu_s": "operator CPU",
              "latency_s": "formation latency"}
    lines += ["", f"Fitted growth over N = {FIT_FROM}…{FIT_TO:,} (log-log least squares): "
              + ", ".join(f"{label} **{_exp(_fit(mixed, key))}**"
                          for key, label in fitted.items()) + ".", "",
              f"Every seal below N = {TELL_IN_SLICES_FROM:,} sends every node the run, roster "
              f"included, once (from N = {QUIET_WATCH_FROM} a member holding its round watches "
              "it quietly, and is sent the run once a round, with the next seal); from "
              f"N = {TELL_IN_SLICES_FROM:,} (`rounds.TELL_IN_SLICES_FROM`) the operator's seal "
              f"writes the round's places into {slices.SLICE_COUNT} `ElasticRunSlice` objects of "
              f"about {TELL_IN_SLICES_FROM // slices.SLICE_COUNT} places each instead, and each "
              "member watches its own slice by name. The largest row is a regime of its own: "
              "bytes per node go from the whole roster to one slice's places there (and the "
              f"operator's writes of a seal from one to at most {slices.SLICE_COUNT + 1}), "
              "which is why the fits above over the whole range show bytes flatter than "
              "either regime. Fitted over "
              f"N = {FIT_FROM}…{TELL_IN_SLICES_FROM // 2:,} alone: "
              + ", ".join(f"{label} **{_exp(_fit(mixed, key, end=TELL_IN_SLICES_FROM // 2))}**"
                          for key, label in fitted.items()) + ".", ""]
    largest = max((r for r in mixed if r.get("formed")), key=lambda r: r["n"], default=None)
    if largest is not None:
        lines += [f"Requests of the round at N = {largest['n']:,}, from the audit log:", "",
                  "| request | count |", "|---|---|"]
        lines += [f"| `{k}` | {v:,} |" for k, v in largest["by_kind"].items()] + [""]
    lines += [*_frozen_table(data.get("frozen") or []), ""]
    if data.get("regimes"):
        lines += [*_regimes_table(data["regimes"]), ""]
    lines += _before_after(data)
    lines += ["## Formation with every node a real handler", "",
              "From the moment all N handlers are built to the last `next_rendezvous()` "
              "returning; median of the repetitions.", "", *formation_lines, ""]
    if plot:
        lines += [f"![scale]({plot})", ""]
    return "\n".join(lines) + "\n"


def write(data: dict[str, Any], out: Path) -> None:
    (out / PAGE).write_text(render(data, _plot(data, out)))


def embedded(out: Path) -> list[str]:
    """The scale page as a section of ``benchmarks.md`` (headings one level down)."""
    page = out / PAGE
    if not page.exists():
        return []
    lines = page.read_text().splitlines()
    return [("#" + line) if line.startswith("#") else line for line in lines]


def main(argv: list[str]) -> int:
    out = Path(argv[0]) if argv else Path("docs")
    write(json.loads((out / "benchmarks-scale.json").read_text()), out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
