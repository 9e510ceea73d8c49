"""Numbers read from environment variables: in their range, or one line naming the variable, value and range."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from core.envvars import env_number, show_number
from core.errors import QuorumError

NAME = "QUORUM_TEST_NUMBER"


class Refused(QuorumError):
    """The caller's own error type."""


@pytest.mark.parametrize(("raw", "expected"), [("", 30.0), ("  ", 30.0), ("0.1", 0.1), ("2.5", 2.5),
                                               (" 604800 ", 604_800.0)])
def test_a_number_in_range_or_unset_is_read(monkeypatch: pytest.MonkeyPatch, raw: str, expected: float) -> None:
    monkeypatch.setenv(NAME, raw)
    assert env_number(NAME, 30.0, 0.1, 604_800.0, means="the lease") == expected


@pytest.mark.parametrize("raw", ["1e308", "inf", "-inf", "nan", "-1", "0", "abc", "1" + "0" * 400, "0x10"])
def test_a_float_setting_out_of_range_is_one_line_naming_it(monkeypatch: pytest.MonkeyPatch, raw: str) -> None:
    # Prepare
    monkeypatch.setenv(NAME, raw)

    # Execute
    with pytest.raises(Refused) as info:
        env_number(NAME, 30.0, 0.1, 604_800.0, means="the lease", unit="seconds", error=Refused)

    # Assert
    assert str(info.value) == f"{NAME}={raw!r}: the lease must be a number of seconds in [0.1, 604,800] (default 30)"


@pytest.mark.parametrize(("raw", "expected"), [("0", 0), ("3", 3), ("+7", 7)])
def test_an_int_setting_reads_a_whole_number(monkeypatch: pytest.MonkeyPatch, raw: str, expected: int) -> None:
    monkeypatch.setenv(NAME, raw)
    value = env_number(NAME, 0, 0, 7, means="the rank")
    assert value == expected and type(value) is int


@pytest.mark.parametrize("raw", ["8", "-1", "2.0", "1e3", "two", "9" * 5000])
def test_an_int_setting_refuses_anything_else(monkeypatch: pytest.MonkeyPatch, raw: str) -> None:
    monkeypatch.setenv(NAME, raw)
    with pytest.raises(QuorumError) as info:
        env_number(NAME, 0, 0, 7, means="the rank")
    assert str(info.value) == f"{NAME}={raw!r}: the rank must be a whole number in [0, 7] (default 0)"


def test_a_required_setting_that_is_unset_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(NAME, raising=False)
    with pytest.raises(QuorumError, match=rf"^{NAME}='': the port must be a whole number in \[1, 65,535\]$"):
        env_number(NAME, None, 1, 65_535, means="the port")


@pytest.mark.parametrize(("number", "shown"), [(0.1, "0.1"), (604_800.0, "604,800"), (1e-10, "1e-10"),
                                               (65_535, "65,535"), (1e20, "1e+20")])
def test_numbers_are_shown_as_a_person_writes_them(number: float, shown: str) -> None:
    assert show_number(number) == shown


@settings(max_examples=200, deadline=None)
@given(st.floats() | st.integers(min_value=-(2**70), max_value=2**70)
       | st.text(st.characters(exclude_categories=("Cs",), exclude_characters="\x00"), max_size=8))
def test_any_value_is_a_finite_number_in_range_or_refused_in_one_line(value: object) -> None:
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(NAME, str(value))
        try:
            number = env_number(NAME, 1.0, 0.5, 1e6, means="the setting")
        except QuorumError as exc:
            assert str(exc).startswith(f"{NAME}=") and "\n" not in str(exc)
            return
    assert math.isfinite(number) and 0.5 <= number <= 1e6
