"""The floor benchmark's one writer: when it updates the board (bench/floor.py)."""

from __future__ import annotations

from bench.floor import next_board_round


def test_the_first_round_waits_for_all_n_leases() -> None:
    assert next_board_round(0, True, 3, 4) == 0
    assert next_board_round(0, True, 4, 4) == 1
    assert next_board_round(0, False, 5, 4) == 1  # listed all at once, and more


def test_every_change_after_the_first_round_is_one_more_round() -> None:
    assert next_board_round(1, True, 3, 4) == 2  # a loss
    assert next_board_round(2, True, 4, 4) == 3  # a newcomer
    assert next_board_round(3, False, 4, 4) == 3  # a renewal, a second ADDED of a name: nothing
    # A loss and a newcomer seen together in a new listing: the set changed, its size not.
    assert next_board_round(3, True, 4, 4) == 4
