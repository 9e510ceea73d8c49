"""A device's ``policy.toml``: every key checked, every bad value refused in one line naming it (issue 48, item 5)."""

from __future__ import annotations

import math
import string
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from clients.policy.errors import PolicyError
from clients.policy.spec import KEYS, SitePolicy, load_policy, parse_policy

DIGEST = "ab" * 32
OTHER = "0123456789abcdef" * 4


def test_a_full_policy_is_read_into_its_rules(tmp_path: Path) -> None:
    # Prepare: every key, a digest in capitals (hex is hex)
    path = tmp_path / "policy.toml"
    path.write_text(f'require_secure_aggregation = true\nmax_epsilon = 8\nmin_cohort = 5\n'
                    f'allowed_tasks = ["{DIGEST.upper()}", "{OTHER}"]\nmax_rounds_per_day = 24\n')

    # Execute
    policy = load_policy(path)

    # Assert: the integer epsilon is a float, the digests lower case
    assert policy == SitePolicy(require_secure_aggregation=True, max_epsilon=8.0, min_cohort=5,
                                allowed_tasks=frozenset({DIGEST, OTHER}), max_rounds_per_day=24)
    assert policy.describe() == ("require_secure_aggregation, max_epsilon = 8, min_cohort = 5, "
                                 "allowed_tasks (2 listed), max_rounds_per_day = 24")


def test_an_empty_file_is_no_rule(tmp_path: Path) -> None:
    path = tmp_path / "policy.toml"
    path.write_text("# nothing asked\n")

    policy = load_policy(path)

    assert policy.is_empty() and policy.describe() == "no rule"


@pytest.mark.parametrize(("text", "expected"), [
    ("max_epsilon = nan", "policy.toml: max_epsilon = nan: must be a number in (0, 1000]"),
    ("max_epsilon = inf", "policy.toml: max_epsilon = inf: must be a number in (0, 1000]"),
    ("max_epsilon = -1.0", "policy.toml: max_epsilon = -1.0: must be a number in (0, 1000]"),
    ("max_epsilon = 0", "policy.toml: max_epsilon = 0: must be a number in (0, 1000]"),
    ("max_epsilon = 1001", "policy.toml: max_epsilon = 1001: must be a number in (0, 1000]"),
    ('max_epsilon = "8"', "policy.toml: max_epsilon = '8': must be a number in (0, 1000]"),
    ("max_epsilon = true", "policy.toml: max_epsilon = True: must be a number in (0, 1000]"),
    ("min_cohort = 0", "policy.toml: min_cohort = 0: must be a whole number from 1 to 1,000,000"),
    ("min_cohort = -3", "policy.toml: min_cohort = -3: must be a whole number from 1 to 1,000,000"),
    ("min_cohort = 5.0", "policy.toml: min_cohort = 5.0: must be a whole number from 1 to 1,000,000"),
    ("min_cohort = 9223372036854775807",
     "policy.toml: min_cohort = 9223372036854775807: must be a whole number from 1 to 1,000,000"),
    ("max_rounds_per_day = 86401", "policy.toml: max_rounds_per_day = 86401: must be a whole number from 1 to 86,400"),
    ("max_rounds_per_day = false", "policy.toml: max_rounds_per_day = False: must be a whole number from 1 to 86,400"),
    ("require_secure_aggregation = 1", "policy.toml: require_secure_aggregation = 1: must be true or false"),
    ('require_secure_aggregation = "yes"', "policy.toml: require_secure_aggregation = 'yes': must be true or false"),
    ('allowed_tasks = "abc"', "policy.toml: allowed_tasks = 'abc': must be a list of SHA-256 digests "
                              "(64 hex digits each)"),
    (f'allowed_tasks = ["{DIGEST}", "{"g" * 64}"]',
     f"policy.toml: allowed_tasks[1] = '{'g' * 56}...: not a SHA-256 digest (64 hex digits)"),
    (f'allowed_tasks = ["{DIGEST[:-1]}"]', f"policy.toml: allowed_tasks[0] = '{DIGEST[:56]}...: "
                                           "not a SHA-256 digest (64 hex digits)"),
    ("allowed_tasks = [1]", "policy.toml: allowed_tasks[0] = 1: not a SHA-256 digest (64 hex digits)"),
    ("max_epsylon = 8", "policy.toml: unknown key 'max_epsylon' (the keys are require_secure_aggregation, "
                        "max_epsilon, min_cohort, allowed_tasks, max_rounds_per_day)"),
    ("[rules]\nmin_cohort = 5", "policy.toml: unknown key 'rules' (the keys are require_secure_aggregation, "
                                "max_epsilon, min_cohort, allowed_tasks, max_rounds_per_day)"),
], ids=lambda v: v if isinstance(v, str) and len(v) < 40 else None)
def test_a_bad_value_is_refused_in_one_line_naming_the_key_and_value(tmp_path: Path, text: str,
                                                                      expected: str) -> None:
    path = tmp_path / "policy.toml"
    path.write_text(text + "\n")

    with pytest.raises(PolicyError) as caught:
        load_policy(path)

    assert str(caught.value) == expected.replace("policy.toml", str(path))


def test_a_file_that_is_no_toml_or_too_big_or_missing_is_refused_naming_it(tmp_path: Path) -> None:
    # Prepare
    broken, big, binary = tmp_path / "broken.toml", tmp_path / "big.toml", tmp_path / "binary.toml"
    broken.write_text("min_cohort = = 5\n")
    big.write_text("# " + "x" * 70_000 + "\n")
    binary.write_bytes(b"min_cohort = 5\n\xff\xfe\n")

    # Execute
    said = []
    for path in (broken, big, binary, tmp_path / "missing.toml"):
        with pytest.raises(PolicyError) as caught:
            load_policy(path)
        said.append(str(caught.value))

    # Assert
    assert said[0].startswith(f"{broken}: not valid TOML: ") and "\n" not in said[0]
    assert said[1] == f"{big}: over 65536 bytes: not a site policy"
    assert said[2] == f"{binary}: not UTF-8 text"
    assert said[3] == f"{tmp_path / 'missing.toml'}: cannot read the site policy (No such file or directory)"


# ----------------------------------------------------------------------------------- properties

_values = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=True, allow_infinity=True),
                    st.text(max_size=80), st.lists(st.one_of(st.integers(), st.text(max_size=70)), max_size=4),
                    st.dictionaries(st.text(max_size=5), st.integers(), max_size=2))
_keys = st.one_of(st.sampled_from(KEYS), st.text(alphabet=string.printable, max_size=20))


@settings(max_examples=400, deadline=None)
@given(raw=st.dictionaries(_keys, _values, max_size=5))
def test_any_parsed_toml_gives_a_policy_or_one_line_naming_a_key(raw: dict[str, object]) -> None:
    # Execute
    try:
        policy = parse_policy(raw)
    except PolicyError as exc:
        message = str(exc)
        # Assert: one line, in the file's name, naming a key it was given (or the unknown one)
        assert "\n" not in message and message.startswith("policy.toml: ") and len(message) < 400
        assert any(repr(k) in message or f"{k} = " in message or f"{k}[" in message for k in raw)
        return
    # Assert: whatever was accepted is within its key's range, of its key's type
    assert set(raw) <= set(KEYS)
    assert policy.max_epsilon is None or (isinstance(policy.max_epsilon, float)
                                          and math.isfinite(policy.max_epsilon) and 0 < policy.max_epsilon <= 1000)
    for count in (policy.min_cohort, policy.max_rounds_per_day):
        assert count is None or (type(count) is int and count >= 1)
    assert all(len(d) == 64 and set(d) <= set("0123456789abcdef") for d in policy.allowed_tasks or ())


@settings(max_examples=200, deadline=None)
@given(epsilon=st.floats(min_value=1e-9, max_value=1000), cohort=st.integers(1, 1_000_000),
       rounds=st.integers(1, 86_400), secure=st.booleans(),
       tasks=st.lists(st.text(alphabet="0123456789abcdefABCDEF", min_size=64, max_size=64), max_size=3))
def test_every_valid_policy_reads_back_as_written(epsilon: float, cohort: int, rounds: int, secure: bool,
                                                  tasks: list[str]) -> None:
    raw = {"require_secure_aggregation": secure, "max_epsilon": epsilon, "min_cohort": cohort,
           "allowed_tasks": tasks, "max_rounds_per_day": rounds}

    policy = parse_policy(raw)

    assert policy == SitePolicy(secure, epsilon, cohort, frozenset(t.lower() for t in tasks), rounds)


@settings(max_examples=200, deadline=None)
@given(value=st.one_of(st.integers(min_value=1_000_001), st.integers(max_value=0),
                       st.integers(min_value=2**63, max_value=2**200)))
def test_a_cohort_out_of_range_however_huge_is_refused(value: int) -> None:
    with pytest.raises(PolicyError, match=r"^policy.toml: min_cohort = -?\d+.*: must be a whole number"):
        parse_policy({"min_cohort": value})


@settings(max_examples=100, deadline=None)
@given(value=st.integers(min_value=10**400, max_value=10**420))
def test_an_epsilon_beyond_floats_is_refused_not_overflowed(value: int) -> None:
    with pytest.raises(PolicyError, match=r"^policy.toml: max_epsilon = \d+.*: must be a number in \(0, 1000\]$"):
        parse_policy({"max_epsilon": value})
