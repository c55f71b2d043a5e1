"""``benchmarks.md`` beside the floor (bench/report.py): the floor's columns, ratios and target.

The page is rendered from hand-made JSON of a run, as ``bench/run.py`` writes
it: with the floor (``backends.k8s.floor``, one row per N and repetition) and
without it, as in the JSON of a run from before the floor was measured.
"""

# ruff: noqa: RUF001 - the page uses en dashes and multiplication signs

from __future__ import annotations

from typing import Any

from bench.report import render

EVENT_N = 4


def _formed(n: int, latency: float) -> dict[str, Any]:
    return {"n": n, "rep": 0, "formed": True, "latency_s": latency, "first_done_s": latency,
            "requests": 3 * n, "writes": n + 2, "lost_cas": 0, "watch_events": n,
            "watch_bytes": 1000 * n, "server_cpu_s": 0.1, "client_cpu_s": 0.1}


def _unformed(n: int, bound: float) -> dict[str, Any]:
    return {"n": n, "rep": 0, "formed": False, "bound_s": bound, "latency_s": None,
            "why": "nodes still busy", "by_kind": {"create leases": n}}


def _floor(n: int, formation: float, loss: float = 0.05, newcomer: float = 0.1
           ) -> dict[str, Any]:
    return {"n": n, "rep": 0, "formation_s": formation, "loss_s": loss, "newcomer_s": newcomer,
            "errors": []}


def _data(k8s: list[dict[str, Any]], floor: list[dict[str, Any]] | None = None,
          c10d: dict[int, float] | None = None) -> dict[str, Any]:
    """A run's JSON: k8s formation rows as given, c10d at 1 s unless told, one recovery and
    one scale-up each; ``floor`` None is a run from before the floor."""
    sizes = sorted({r["n"] for r in k8s})
    c10d = c10d or dict.fromkeys(sizes, 1.0)
    k8s_result: dict[str, Any] = {
        "formation": k8s, "errors": [], "load": [1.0],
        "recovery": [{"n": EVENT_N, "rep": 0, "survivors": EVENT_N - 1,
                      "signalled": EVENT_N - 1, "window_s": 10.0, "trigger": "shutdown()",
                      "seen_all_s": 0.1, "new_round_s": 0.2}],
        "scale_up": [{"n": EVENT_N, "rep": 0, "members": EVENT_N, "signalled": EVENT_N,
                      "seen_all_s": 0.05, "new_round_s": 0.3}]}
    if floor is not None:
        k8s_result["floor"] = floor
    c10d_result = {
        "formation": [_formed(n, c10d[n]) for n in sizes], "errors": [], "load": [1.0],
        "recovery": [{"n": EVENT_N, "rep": 0, "survivors": EVENT_N - 1, "signalled": 0,
                      "window_s": 5.0, "trigger": "SIGKILL", "reentry_to_round_s": 1.0,
                      "reentered_after_s": 5.0}],
        "scale_up": [{"n": EVENT_N, "rep": 0, "members": EVENT_N, "signalled": 0,
                      "seen_all_s": None, "new_round_s": 3.0}]}
    return {"command": "make bench-quick", "seconds": 60.0, "started": "today", "quick": True,
            "commit": "abc", "versions": {"python": "3.11"},
            "machine": {"nproc": 2, "cpu": "cpu", "memory_gib": 8, "kernel": "6.1"},
            "plan": {"sizes": sizes, "reps": 1, "event_reps": 1, "event_n": EVENT_N,
                     "workers": 2, "floor_reps": 1},
            "backends": {"k8s": k8s_result, "c10d": c10d_result}}


def _table(text: str, header: str) -> list[str]:
    """The rows of the table whose header line starts with ``header``."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header))
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            return rows
        rows.append(line)
    return rows


FORMATION = "| N | k8s | c10d | floor | k8s / floor | k8s / c10d |"
RECOVERY = "| backend | trigger |"
SCALE_UP = "| backend | members signalled |"


def _headlines(text: str) -> str:
    return text.split("## Headlines")[1].split("## Targets", maxsplit=1)[0]


def _target(text: str) -> str:
    return next(row for row in _table(text, "| target | result |")
                if row.startswith("| k8s formation ≤ 1.5× the floor"))


def test_without_the_floor_its_columns_show_a_dash_and_its_target_is_not_measured() -> None:
    text = render(_data([_formed(2, 0.3), _formed(4, 0.4)]), [])
    assert _table(text, FORMATION) == [
        "| 2 | 0.300 s | 1.000 s | – | – | 0.30× | – | 0.300 s |",
        "| 4 | 0.400 s | 1.000 s | – | – | 0.40× | – | 0.400 s |"]
    assert "(not measured in this run)" in text
    assert _target(text) == ("| k8s formation ≤ 1.5× the floor at every N | not measured "
                             "(no floor in this run) |")
    assert _table(text, RECOVERY)[0] == "| k8s | shutdown() | 3–3 of 3 | 0.100 s | – | – | " \
                                        "0.200 s | – |"
    assert _table(text, SCALE_UP)[0] == "| k8s | 4–4 of 4 | 0.050 s | 0.300 s | – | – |"
    assert "floor" not in _headlines(text)


def test_the_floor_column_and_k8s_over_the_floor_beside_k8s_over_c10d() -> None:
    text = render(_data([_formed(2, 0.3), _formed(4, 0.4)],
                        [_floor(2, 0.2), _floor(4, 0.32)]), [])
    assert _table(text, FORMATION) == [
        "| 2 | 0.300 s | 1.000 s | 0.200 s | 1.50× | 0.30× | – | 0.300 s |",
        "| 4 | 0.400 s | 1.000 s | 0.320 s | 1.25× | 0.40× | – | 0.400 s |"]
    assert "(once per N; – where it was not)" in text


def test_repetitions_of_the_floor_show_their_median_and_range() -> None:
    floor = [_floor(2, 0.2), {**_floor(2, 0.6), "rep": 1}, {**_floor(2, 0.25), "rep": 2}]
    data = _data([_formed(2, 0.5)], floor)
    data["plan"]["floor_reps"] = 3
    text = render(data, [])
    assert _table(text, FORMATION) == [
        "| 2 | 0.500 s | 1.000 s | 0.250 s (0.200 s–0.600 s) | 2.00× | 0.50× | – | 0.500 s |"]
    assert "(3 times per N, median (min–max); – where it was not)" in text


def test_the_target_is_met_at_one_and_a_half_times_the_floor_and_names_the_worst_n() -> None:
    # 0.75 / 0.5 is 1.5 exactly in binary floating point (0.3 / 0.2 is a little less).
    text = render(_data([_formed(2, 0.75), _formed(4, 0.4)],
                        [_floor(2, 0.5), _floor(4, 0.32)]), [])
    assert _target(text) == ("| k8s formation ≤ 1.5× the floor at every N | met at every N "
                             "measured (worst 1.50× at N = 2) |")
    assert ("* Forming a round of 2–4 nodes takes 1.25–1.50× the time of the floor, the "
            "cheapest rendezvous this API server allows (N clients, one Lease each, one watch "
            "event of one object; target ≤ 1.5×).") in _headlines(text)


def test_the_target_is_missed_where_k8s_takes_more_or_did_not_form() -> None:
    k8s = [_formed(2, 0.3), _formed(4, 0.8), _unformed(8, 60.0)]
    text = render(_data(k8s, [_floor(2, 0.2), _floor(4, 0.32), _floor(8, 2.0)],
                        c10d={2: 1.0, 4: 1.0, 8: 1.5}), [])
    assert _target(text) == ("| k8s formation ≤ 1.5× the floor at every N | missed at N = "
                             "4 (2.50×), 8 (> 30×: not formed) |")
    assert _table(text, FORMATION)[2] == ("| 8 | **not formed within 60 s** | 1.500 s | "
                                          "2.000 s | > 30× | > 40× | – | – |")


def test_a_size_without_a_floor_is_named_in_the_target() -> None:
    text = render(_data([_formed(2, 0.3), _formed(4, 0.4)], [_floor(2, 0.2)]), [])
    assert _target(text) == ("| k8s formation ≤ 1.5× the floor at every N | met at every N "
                             "measured (worst 1.50× at N = 2); no floor at N = 4 |")
    assert _table(text, FORMATION)[1] == "| 4 | 0.400 s | 1.000 s | – | – | 0.40× | – | 0.400 s |"


def test_loss_and_newcomer_are_compared_with_the_floor_at_the_scenarios_n() -> None:
    # The floor at the scenarios' N (4) counts; the one at 2 must not.
    floor = [_floor(2, 0.2, loss=1.0, newcomer=1.0), _floor(EVENT_N, 0.3, loss=0.05,
                                                            newcomer=0.1)]
    text = render(_data([_formed(2, 0.3), _formed(EVENT_N, 0.4)], floor), [])
    recovery = _table(text, RECOVERY)
    assert recovery[0] == ("| k8s | shutdown() | 3–3 of 3 | 0.100 s | 0.050 s | 2.00× | "
                           "0.200 s | – |")
    assert recovery[1] == "| c10d | SIGKILL | 0–0 of 3 (watched 5 s) | – | – | – | – | 1.000 s |"
    scale = _table(text, SCALE_UP)
    assert scale == ["| k8s | 4–4 of 4 | 0.050 s | 0.300 s | 0.100 s | 3.00× |",
                     "| c10d | 0–0 of 4 | – | 3.000 s | – | – |"]
    assert ("* A lost member reaches every survivor in 2.00× the floor's loss, and a late "
            "node's round forms in 3.00× the floor's newcomer.") in _headlines(text)


def test_no_floor_at_the_scenarios_n_leaves_its_loss_and_newcomer_columns_empty() -> None:
    text = render(_data([_formed(2, 0.3), _formed(EVENT_N, 0.4)], [_floor(2, 0.2)]), [])
    assert _table(text, RECOVERY)[0] == ("| k8s | shutdown() | 3–3 of 3 | 0.100 s | – | – | "
                                         "0.200 s | – |")
    assert _table(text, SCALE_UP)[0] == "| k8s | 4–4 of 4 | 0.050 s | 0.300 s | – | – |"
    assert "the floor's loss" not in _headlines(text)
    assert "the time of the floor" in _headlines(text)


def test_k8s_over_c10d_is_held_to_issue_36s_target_and_says_by_how_much_it_missed() -> None:
    """At most 0.3 x c10d at every N: 0.30 is met, 0.45 missed by 1.5 x."""
    def row(text: str) -> str:
        return next(r for r in _table(text, "| target | result |")
                    if r.startswith("| k8s formation ≤ 0.3× c10d at every N"))

    assert row(render(_data([_formed(2, 0.3), _formed(4, 0.2)]), [])).endswith(
        "| met at every N |")
    assert row(render(_data([_formed(2, 0.3), _formed(4, 0.45)]), [])).endswith(
        "| missed at N = 4 (0.45×, 1.5× over) |")


def test_a_size_that_missed_k8s_over_c10d_is_headlined_as_it_was() -> None:
    """Slower, or faster but above the target; the resolver's 5 s step only where the
    median round waited it out after its first node was back."""
    stepped = {**_formed(4, 5.6), "first_done_s": 0.4}
    above = {**_formed(8, 0.45), "first_done_s": 0.4}
    headlines = _headlines(render(_data([_formed(2, 0.2), stepped, above]), []))
    assert ("At N = 4 elasticrun is 5.6× slower than c10d to form a round (first node back "
            "after 0.4 s); the time goes in a step of 5 s") in headlines
    assert ("At N = 8 elasticrun takes 0.45× the time of c10d to form a round, above the "
            "0.3× target (first node back after 0.4 s).") in headlines
    assert headlines.count("step of 5 s") == 1 and "0.5× slower" not in headlines


def test_the_formation_section_says_whether_the_operator_ran() -> None:
    """From ``maxNodes`` = 64 nodes leave the seal to the operator: a run measured without
    it times the fallback for an operator that is down, and the page must say which."""
    data = _data([_formed(2, 0.3)])
    assert "k8s runs without the operator" in render(data, [])
    data["backends"]["k8s"]["formation_operator"] = True
    text = render(data, [])
    assert "k8s runs with the operator running, as the Helm chart installs it" in text
    assert "without the operator" not in text
