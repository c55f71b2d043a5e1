"""The Resize section of ``benchmarks.md``, from ``resize.<column>`` in the JSON.

Each column is one ``python bench/run.py --only resize --column NAME`` run
(for example ``before`` and ``after`` a change), k8s and c10d side by side in
it, so that the ratios compare numbers taken on the same loaded machine.
"""

# The report is typeset for people: en dashes for ranges, times signs for ratios.
# ruff: noqa: RUF001, RUF002

from __future__ import annotations

from typing import Any

from bench.resize import CASES, LAST_CALL, LEAD, MONITOR_INTERVAL, SETUP_LAST_CALL, Case
from bench.stats import summary

Row = dict[str, Any]
#: Columns in this order first; others after them, by name.
COLUMN_ORDER = ("before", "after")
VARIANT_TITLES = {"owner": "k8s, Job owner", "no owner": "k8s, no owner", "c10d": "c10d"}


def _columns(data: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    found = data.get("resize") or {}
    names = [c for c in COLUMN_ORDER if c in found] + sorted(set(found) - set(COLUMN_ORDER))
    return [(name, found[name]) for name in names]


def _rows(column: dict[str, Any], variant: str, case: Case) -> list[Row]:
    backend = "c10d" if variant == "c10d" else "k8s"
    rows = ((column.get("backends") or {}).get(backend) or {}).get("rows") or []
    return [r for r in rows if r.get("case") == case.key and r.get("variant") == variant]


def _seconds(value: float) -> str:
    return f"{value:.2f} s" if value < 10 else f"{value:.1f} s"


def _span(values: list[float], unit: str = "s") -> str:
    """Median (min–max) of the repetitions."""
    s = summary(values)
    if s is None:
        return "–"
    if unit == "s":
        if s["min"] == s["max"]:
            return _seconds(s["median"])
        return f"{_seconds(s['median'])} ({_seconds(s['min'])}–{_seconds(s['max'])})"
    low, high = int(s["min"]), int(s["max"])
    return f"{low}" if low == high else f"{low}–{high}"


def median_round(rows: list[Row]) -> float | None:
    s = summary(r.get("round_s") for r in rows if r.get("formed"))
    return s["median"] if s else None


def cell(rows: list[Row]) -> str:
    """Time to the round of the new size, and the old members' restarts, over the repetitions."""
    if not rows:
        return "–"
    formed = [r for r in rows if r.get("formed")]
    if not formed:
        return f"**not formed** ({len(rows)} of {len(rows)})"
    text = _span([r["round_s"] for r in formed])
    restarts = [r["restarts"] for r in formed if "restarts" in r]
    if restarts:
        text += f", {_span(restarts, 'n')} restart" + ("" if max(restarts) == 1 else "s")
    elif formed[0].get("newcomers"):
        again = [r.get("newcomer_restarts", 0) for r in formed]
        text += f", {_span(again, 'n')} re-entries" if max(again) else ", no re-entry"
    if formed[0].get("members") and all(r.get("signalled") == 0 for r in formed):
        again = [r["reentry_to_round_s"] for r in formed if "reentry_to_round_s" in r]
        text += f" (not signalled; re-entry → round {_span(again)})"
    if len(formed) < len(rows):
        text += f"; **{len(rows) - len(formed)} of {len(rows)} not formed**"
    return text


def _ratio(a: float | None, b: float | None) -> str:
    if a is None or b is None or b == 0:
        return "–"
    return f"{a / b:.2f}×" if a / b >= 0.01 else f"{a / b:.1g}×"


def ratio_cell(owner: list[Row], c10d: list[Row]) -> str:
    """owner / c10d of the median times; against c10d's re-entry when it was never signalled."""
    mine = median_round(owner)
    if mine is None:
        return "–"
    formed = [r for r in c10d if r.get("formed")]
    if formed and formed[0].get("members") and all(r.get("signalled") == 0 for r in formed):
        again = summary(r.get("reentry_to_round_s") for r in formed)
        return f"{_ratio(mine, again['median'] if again else None)} of its re-entry"
    return _ratio(mine, median_round(c10d))


def _measured(name: str, column: dict[str, Any]) -> str:
    loads = [r["load"] for b in (column.get("backends") or {}).values()
             for r in b.get("rows", []) if "load" in r]
    load = f", 1-minute load {min(loads):.1f}–{max(loads):.1f}" if loads else ""
    return (f"Column `{name}`: commit `{column.get('commit', 'unknown')}`, measured "
            f"{column.get('started', '?')} by `{column.get('command', '?')}` in "
            f"{column.get('seconds', 0) / 60:.1f} min, {column.get('reps', '?')} "
            f"repetition{'' if column.get('reps') == 1 else 's'} of each resize{load}.")


def _desired_note(column: dict[str, Any]) -> str:
    rows = [r for r in ((column.get("backends") or {}).get("k8s") or {}).get("rows", [])
            if r.get("variant") == "owner"]
    if not rows:
        return ""
    read = sum(1 for r in rows if r.get("desired_in_status") == r.get("target"))
    return (f"`status.desired` equal to the Job's parallelism after the resize in {read} of "
            f"{len(rows)} repetitions with an owner.")


def section(data: dict[str, Any]) -> list[str]:
    """The Resize section, or nothing when no column was measured."""
    columns = _columns(data)
    if not columns:
        return []
    lines = ["## Resize: a running round grows or shrinks", "",
             f"Every node runs torch's agent loop: it looks at `num_nodes_waiting()` every "
             f"{MONITOR_INTERVAL:g} s (torchrun's monitor interval) and re-enters "
             "`next_rendezvous()` when it is positive; each entry of an old member is one "
             "restart of its workers. A run `min:max` forms its round before with a last call "
             f"of {SETUP_LAST_CALL} s, then every node has torch's default last call "
             f"({LAST_CALL} s), for both backends. New agents start 1 s apart (first "
             f"formation: 0.5 s), their handlers built and their Pods created {LEAD:g} s "
             "before the first starts.", "",
             "* **time** (median, min–max): from the last new agent's start (scale-down: "
             "from the Pod's deletion and its agent's SIGKILL) until every node has returned "
             "from the round of the new size; **restarts**: how many times each old member "
             "re-entered for it (first formation: re-entries of the new agents).",
             "* **k8s, Job owner**: the operator runs; the run's Pods are Pod objects owned by "
             "an Indexed `batch/v1` Job (parallelism = completions), named as the nodes' "
             "`POD_NAME`. The Job's `spec.parallelism` is patched to the new size when the "
             "new Pods are created (scale-down: lowered by one with the deletion). No Job "
             "controller runs: the API server keeps the Job, the benchmark plays its pods.",
             "* **k8s, no owner**: the same Pods with the run label only: the rules without a "
             "desired size.",
             "* **c10d**: torch's TCPStore backend; a dead member is never reported to the "
             "survivors, so they re-enter by themselves 5 s after the SIGKILL (the keep-alive "
             "expiry plus 2 s; a real job waits for its collective to time out) and the "
             "re-entry is timed on its own.",
             "* Timings come from a loaded shared machine: compare the columns side by side "
             "within one run (the ratio), not across pages.", ""]
    for name, column in columns:
        lines += [f"### `{name}`", "", _measured(name, column), "",
                  "| resize | k8s, Job owner | k8s, no owner | c10d | owner / c10d |",
                  "|---|---|---|---|---|"]
        for case in CASES:
            cells = {v: _rows(column, v, case) for v in VARIANT_TITLES}
            if not any(cells.values()):
                continue
            lines.append(f"| {case.title} | {cell(cells['owner'])} | {cell(cells['no owner'])} "
                         f"| {cell(cells['c10d'])} | "
                         f"{ratio_cell(cells['owner'], cells['c10d'])} |")
        note = _desired_note(column)
        errors = [e for b in (column.get("backends") or {}).values() for e in b.get("errors", [])]
        lines += [""] + ([note, ""] if note else [])
        if errors:
            lines += ["Errors: " + "; ".join(errors[:5]), ""]
    lines += _comparison(dict(columns))
    lines += _reading(*columns[-1])
    return lines


def _case(key: str) -> Case:
    return next(c for c in CASES if c.key == key)


def _restarts(rows: list[Row]) -> str:
    found = [r["restarts"] for r in rows if r.get("formed") and "restarts" in r]
    return _span(found, "n") if found else "–"


def _time(rows: list[Row]) -> str:
    t = median_round(rows)
    return "–" if t is None else _seconds(t)


def _comparison(columns: dict[str, dict[str, Any]]) -> list[str]:
    """The owner's column before and after, beside the after run's no-owner and c10d."""
    if not {"before", "after"} <= set(columns):
        return []
    before, after = columns["before"], columns["after"]
    lines = ["### What the owner buys: `before` → `after`", "",
             "| resize | Job owner, before | Job owner, after | no owner, after | c10d, after |",
             "|---|---|---|---|---|"]
    for case in CASES:
        if not _rows(after, "owner", case):
            continue
        lines.append(f"| {case.title} | {cell(_rows(before, 'owner', case))} | "
                     f"{cell(_rows(after, 'owner', case))} | "
                     f"{cell(_rows(after, 'no owner', case))} | "
                     f"{cell(_rows(after, 'c10d', case))} |")
    return [*lines, ""]


def _reading(name: str, column: dict[str, Any]) -> list[str]:
    """What the numbers of the last column say, each sentence computed from them."""
    def rows(variant: str, key: str) -> list[Row]:
        return _rows(column, variant, _case(key))

    ups = ("up-2-4", "up-2-4-of-8", "up-2-8")
    if not all(rows(v, k) for v in VARIANT_TITLES for k in ups):
        return []
    per = {v: ", ".join(_restarts(rows(v, k)) for k in ups) for v in VARIANT_TITLES}
    first = {v: _time(rows(v, "first-4")) for v in VARIANT_TITLES}
    down = {v: _time(rows(v, "down-4-3")) for v in VARIANT_TITLES}
    again = summary(r.get("reentry_to_round_s") for r in rows("c10d", "down-4-3"))
    lines = [f"Reading (`{name}`):", ""]
    once = [r.get("restarts") for k in ups for r in rows("owner", k)]
    t_owner = median_round(rows("owner", "up-2-4"))
    t_none = median_round(rows("no owner", "up-2-4"))
    if once and set(once) == {1} and t_owner is not None and t_none is not None:
        lines.append(
            "* **What the owner buys.** In a torchrun job every restart stops all workers and "
            "reloads the last checkpoint. With the Job as owner a scale-up costs each old "
            "member one restart however many nodes come (2 → 8: "
            f"{_restarts(rows('no owner', 'up-2-8'))} without an owner), and a Job's first "
            f"round is there {first['owner']} after its last join instead of "
            f"{first['no owner']}. From the last new agent's start to the bigger round it "
            f"takes {_seconds(t_owner)} against {_seconds(t_none)} without an owner (2 → 4 in "
            "`2:4`): the gain is in restarts and in last calls not waited out. c10d gets its "
            "one restart by waiting on its last call, which a first formation pays in full "
            "and a scale-up below `maxNodes` in part.")
    lines += [
             "* **Scale-up.** Restarts of the old members for 2 → 4 in `2:4`, 2 → 4 in "
             f"`2:8` and 2 → 8 in `2:8`: {per['owner']} with the Job as owner; "
             f"{per['no owner']} without, each newcomer that arrives after the members "
             f"re-entered making a round of its own; {per['c10d']} for c10d, which "
             f"restarts once only because its {LAST_CALL} s last call "
             "holds the round open: where the new size is `maxNodes` the round completes as "
             f"the last agent joins ({_time(rows('c10d', 'up-2-4'))} for 2 → 4 in `2:4`), "
             "where it is below `maxNodes` the round waits out the rest of the last call "
             f"({_time(rows('c10d', 'up-2-4-of-8'))} for 2 → 4 in `2:8`, against "
             f"{_time(rows('owner', 'up-2-4-of-8'))} with the owner). A shorter last call "
             "is c10d's only other choice: less waiting, one restart per newcomer.",
             f"* **First formation.** A Job of 4 on a run `2:8` holds its round "
             f"{first['owner']} after the 4th join with the Job as owner; {first['no owner']} "
             f"without (the last call, counted from the 2nd join); c10d {first['c10d']}.",
             f"* **Scale-down.** The operator sees the Pod go, and the survivors hold the "
             f"round of 3 {down['owner']} after the deletion with the owner "
             f"({down['no owner']} without). c10d never tells the survivors; once they "
             "re-enter (in a real job: when their collective times out) their round of 3 "
             "waits out the last call again"
             + (f" ({_seconds(again['median'])} from the re-entry)." if again else "."),
             ""]
    return lines


def headlines(data: dict[str, Any]) -> list[str]:
    """One line on what an owner buys, from the last column measured (none without one)."""
    columns = _columns(data)
    if not columns:
        return []
    name, column = columns[-1]
    up = next(c for c in CASES if c.key == "up-2-4")
    first = next(c for c in CASES if c.key == "first-4")
    owner = _rows(column, "owner", up)
    restarts = [r["restarts"] for r in owner if r.get("formed") and "restarts" in r]
    t_owner, t_first = median_round(owner), median_round(_rows(column, "owner", first))
    t_c10d_first = median_round(_rows(column, "c10d", first))
    if not restarts or t_owner is None or t_first is None:
        return []
    times = {"1": "once", "2": "twice"}.get(_span(restarts, "n"), f"{_span(restarts, 'n')} times")
    text = (f"Resize (`{name}`): with its Job as owner, a run scaled from 2 to 4 nodes restarts "
            f"its members {times} and holds the round of 4 {_seconds(t_owner)} after the last "
            "new agent "
            f"started; a Job of 4 on a run `2:8` forms {_seconds(t_first)} after its 4th join")
    if t_c10d_first is not None:
        text += f" (c10d: {_seconds(t_c10d_first)}, its last call)"
    return [text + "."]
