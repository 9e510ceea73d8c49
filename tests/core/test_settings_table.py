"""Instruction settings: one typed table in ``core.instructions``; nothing else spells a key or holds a stray one."""

from __future__ import annotations

import ast
import math
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from core.instructions import (
    CODEC_BITS,
    DOWNLINK_BITS,
    DP_ADAPTIVE,
    DP_CLIP,
    SCAFFOLD_CONTROL,
    SETTINGS,
    STD_MEAN,
    STD_PASS,
    TrainConfig,
)

ROOT = Path(__file__).resolve().parents[2]
PRODUCT = ("core", "runstore", "scenarios", "learning", "privacy", "aggregator", "clients", "runtimes", "deploy",
           "dashboard", "quorum")
BASE = TrainConfig(round=1, epochs=1, batch_size=8, lr=0.1, seed=0)


def test_a_config_s_settings_cannot_be_changed_after_they_were_checked() -> None:
    config = BASE.with_settings({DP_CLIP: 1.0})
    with pytest.raises(TypeError):
        config.settings["dp-clip"] = "x"  # type: ignore[index]
    assert config.get(DP_CLIP) == 1.0


def test_a_newer_aggregators_setting_fails_the_task_naming_it_never_ignored() -> None:
    from core.errors import UpdateRejected
    from core.instructions import quorum_settings, train_instruction

    content = train_instruction(np.zeros(3, np.float32), BASE)
    content["config"]["x.dp-new-feature"] = 1.0
    with pytest.raises(UpdateRejected, match=r"x\.dp-new-feature .*newer Quorum"):
        quorum_settings(content)


def test_settings_read_back_typed_through_the_wire() -> None:
    config = BASE.with_settings({DP_CLIP: 2, DP_ADAPTIVE: True, DOWNLINK_BITS: 16, STD_MEAN: [1, 2.5],
                                 STD_PASS: "means", SCAFFOLD_CONTROL: b"\x00" * 8})
    back = TrainConfig.from_record(config.to_record())
    assert back == config
    assert back.get(DP_CLIP) == 2.0 and isinstance(back.get(DP_CLIP), float)  # an integer clip is a float
    assert back.get(STD_MEAN) == [1.0, 2.5] and back.get(DOWNLINK_BITS) == 16 and back.get(CODEC_BITS) is None
    assert config.to_record()["x.dp-clip"] == 2.0 and "x.cx-bits" not in config.to_record()


@pytest.mark.parametrize(("settings", "named"), [
    ({"dp-clp": 1.0}, "x.dp-clp"),                 # a misspelt key: not one of Quorum's settings
    ({"dp-clip": "1.0"}, "x.dp-clip"),             # a string for a number
    ({"dp-clip": float("nan")}, "x.dp-clip"),      # NaN is no clip norm
    ({"dp-noise-std": float("inf")}, "x.dp-noise-std"),  # nor is infinity a noise level
    ({"std-limit": 10**400}, "x.std-limit"),       # an integer beyond float's range
    ({"dl-bits": True}, "x.dl-bits"),              # a boolean is not an integer
    ({"dl-bits": 16.0}, "x.dl-bits"),              # nor is a float
    ({"dp-adaptive": 1}, "x.dp-adaptive"),         # nor an integer a boolean
    ({"std-mean": [1.0, "a"]}, "x.std-mean"),      # a list with a non-number
    ({"scaffold-c": [1.0]}, "x.scaffold-c"),       # the control variate travels as bytes
])
def test_a_stray_or_mistyped_setting_is_refused_naming_it(settings: dict, named: str) -> None:
    with pytest.raises(ValueError, match=named.replace(".", r"\.")):
        TrainConfig(round=1, epochs=1, batch_size=8, lr=0.1, seed=0, settings=settings)
    record = BASE.to_record()
    for key, value in settings.items():
        try:
            record[f"x.{key}"] = value
        except TypeError:  # Flower's record refuses a mixed list itself
            return
    with pytest.raises(ValueError, match=named.replace(".", r"\.")):  # and so is an instruction carrying it
        TrainConfig.from_record(record)


values = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=True),
                   st.text(max_size=8), st.binary(max_size=8),
                   st.lists(st.one_of(st.floats(allow_nan=True), st.integers(-2**40, 2**40), st.text(max_size=2)),
                            max_size=4))


@given(key=st.sampled_from(sorted(SETTINGS)), value=values)
def test_any_value_a_server_sends_reads_as_its_settings_type_or_is_refused(key: str, value: object) -> None:
    record = BASE.to_record()
    try:
        record[f"x.{key}"] = value  # type: ignore[assignment]
    except (TypeError, ValueError):
        return  # Flower's record itself refuses it
    try:
        config = TrainConfig.from_record(record)
    except ValueError as exc:
        assert f"x.{key}" in str(exc)
        return
    got = config.get(SETTINGS[key])
    kind = SETTINGS[key].kind
    assert isinstance(got, kind) and (kind is bool or not isinstance(got, bool))
    if kind is float:
        assert math.isfinite(got)  # type: ignore[arg-type]
    if kind is list:
        assert all(isinstance(v, float) and math.isfinite(v) for v in got)  # type: ignore[union-attr]


def test_no_product_module_but_core_instructions_spells_a_setting_key() -> None:
    keys = set(SETTINGS) | {f"x.{k}" for k in SETTINGS}
    found = []
    for package in PRODUCT:
        for path in (ROOT / package).rglob("*.py"):
            if path == ROOT / "core" / "instructions.py":
                continue
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.Constant) and node.value in keys:
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.value!r}")
    assert not found, found
    assert "extra" not in {f for f in TrainConfig.__dataclass_fields__}
