"""Every byte a client sends crosses one parsing boundary: junk rejects that reply, never the run (issue 32).

numpy's ``.npy`` header reader tokenises the header text, so unbalanced
brackets (``'shape': (]]8,)``) raise ``tokenize.TokenError``, not the
``ValueError`` the decoders used to catch. The property tests throw arbitrary
bytes and valid-looking headers with junk spliced in at the plain (Quorum
delta), Flower-layout (``arrays``) and secure-aggregation (masked input)
decoders: each answers with a parsed reply or the project's own rejection
error, never anything else.
"""

from __future__ import annotations

import io
import random
import tokenize

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, MetricRecord, RecordDict
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from core.boundary import one_line, rejects_any
from core.errors import UpdateRejected
from core.eval_replies import parse_eval_reply
from core.layouts import ParamLayout, npy_bytes, npy_view
from core.replies import parse_train_reply
from privacy.secagg.errors import SecAggProtocolError
from privacy.secagg.flower_records import MASKED_RECORD, RECORD, read_reply
from privacy.secagg.messages import MaskedInput
from privacy.secagg.stage import Stage

SIZE = 8
LAYOUT = ParamLayout.of({"w": (SIZE,)})
HEADER = "{'descr': '<f4', 'fortran_order': False, 'shape': (8,), }"
TOKEN_ERROR_HEADER = HEADER.replace("(8,)", "(]]8,)")
#: Characters that upset a tokenizer or ``ast.literal_eval``: brackets, quotes, escapes, comments, newlines.
_NASTY = "()[]{}'\",:#\\\n\t 0123456789-+.eEjxLu<>|fiObTrueFalseNone\x00\xff"


def npy_payload(header: str, body: bytes = b"", version: int = 1) -> bytes:
    """A ``.npy`` payload with ``header`` as its header text (padded as numpy pads), then ``body``."""
    text = header.encode("latin1")
    width = 2 if version == 1 else 4
    pad = (-(6 + 2 + width + len(text) + 1)) % 64
    text += b" " * pad + b"\n"
    return b"\x93NUMPY" + bytes([version, 0]) + len(text).to_bytes(width, "little") + text + body


def plain_reply(data: bytes) -> RecordDict:
    delta = Array(dtype="float32", shape=(SIZE,), stype="numpy.ndarray", data=data)
    return RecordDict({"update": ArrayRecord({"delta": delta}), "metrics": MetricRecord({"num-examples": 10})})


def flower_reply(data: bytes) -> RecordDict:
    tensor = Array(dtype="float32", shape=(SIZE,), stype="numpy.ndarray", data=data)
    return RecordDict({"arrays": ArrayRecord({"w": tensor}), "metrics": MetricRecord({"num-examples": 10})})


def masked_reply(data: bytes, payload: bytes = b"", stage: Stage = Stage.MASKED_INPUT) -> RecordDict:
    vector = Array(dtype="uint32", shape=(SIZE,), stype="numpy.ndarray", data=data)
    header = ConfigRecord({"stage": stage.value, "round": 1, "payload": payload})
    return RecordDict({MASKED_RECORD: ArrayRecord({"vector": vector}), RECORD: header})


def parse_plain(data: bytes) -> object:
    return parse_train_reply(plain_reply(data), SIZE, 10**6)


def parse_flower(data: bytes) -> object:
    return parse_train_reply(flower_reply(data), SIZE, 10**6, reference=np.zeros(SIZE, np.float32), layout=LAYOUT)


def parse_masked(data: bytes) -> object:
    return read_reply(Stage.MASKED_INPUT, 1, masked_reply(data))


PATHS = {"plain": (parse_plain, UpdateRejected), "flower": (parse_flower, UpdateRejected),
         "secagg": (parse_masked, SecAggProtocolError)}


# -- the reproduction, on each path ---------------------------------------------------------

def test_numpy_itself_raises_a_token_error_on_the_header() -> None:
    # the premise: not a ValueError, so a decoder that catches ValueError alone lets it through
    with pytest.raises(tokenize.TokenError):
        np.load(io.BytesIO(npy_payload(TOKEN_ERROR_HEADER, bytes(4 * SIZE))))


@pytest.mark.parametrize("path", sorted(PATHS))
def test_a_header_with_unbalanced_brackets_is_rejected_with_the_reason(path: str) -> None:
    parse, error = PATHS[path]
    with pytest.raises(error, match="TokenError"):
        parse(npy_payload(TOKEN_ERROR_HEADER, bytes(4 * SIZE)))


@pytest.mark.parametrize("header", [HEADER.replace("(8,)", "(8,"), HEADER.replace("'<f4'", "'<f4"),
                                    HEADER.replace("(8,)", "(" * 200 + ")" * 200), "{" + "[" * 5000 + "}"],
                         ids=["eof-in-tuple", "unterminated-string", "deep-nesting", "huge-nesting"])
@pytest.mark.parametrize("path", sorted(PATHS))
def test_other_header_junk_is_rejected(path: str, header: str) -> None:
    parse, error = PATHS[path]
    with pytest.raises(error):
        parse(npy_payload(header, bytes(4 * SIZE)))


def test_a_well_formed_reply_still_parses_on_every_path() -> None:
    floats = npy_bytes(np.arange(SIZE, dtype=np.float32))
    assert parse_plain(floats).delta.tolist() == list(range(SIZE))  # type: ignore[attr-defined]
    assert parse_flower(floats).delta.tolist() == list(range(SIZE))  # type: ignore[attr-defined]
    masked = parse_masked(npy_bytes(np.arange(SIZE, dtype=np.uint32)))
    assert isinstance(masked, MaskedInput) and masked.vector.tolist() == list(range(SIZE))


def test_a_masked_input_claiming_a_huge_matrix_is_refused_without_allocating_it() -> None:
    huge = "{'descr': '<u4', 'fortran_order': False, 'shape': (100000, 100000), }"
    with pytest.raises(SecAggProtocolError, match="expected a 1-D vector"):
        parse_masked(npy_payload(huge, bytes(64)))


def test_the_rejection_reason_is_one_line_and_bounded() -> None:
    @rejects_any("test reply")
    def parse(_: bytes) -> None:
        raise SyntaxError("line one\nline two " + "x" * 1000)
    with pytest.raises(UpdateRejected) as info:
        parse(b"")
    reason = str(info.value)
    assert reason.startswith("test reply could not be parsed: SyntaxError: line one line two")
    assert "\n" not in reason and len(reason) <= 340
    assert one_line(ValueError()) == "ValueError"


def test_the_boundary_lets_its_own_rejection_through_unchanged() -> None:
    @rejects_any("test reply")
    def parse(_: bytes) -> None:
        raise UpdateRejected("num-examples must be an integer")
    with pytest.raises(UpdateRejected, match="^num-examples must be an integer$"):
        parse(b"")


# -- properties: arbitrary bytes and valid-looking headers, every path ------------------------------

def mangled(rng: random.Random) -> str:
    """The honest header with junk spliced in: a few characters inserted, replaced or cut."""
    text = HEADER
    for _ in range(rng.randint(1, 4)):
        at, cut = rng.randint(0, len(text)), rng.randint(0, 3)
        text = text[:at] + "".join(rng.choices(_NASTY, k=rng.randint(0, 6))) + text[at + cut:]
    return text


def fields(rng: random.Random) -> str:
    """A header of the right form whose values are anything: odd dtypes, shapes, flags, or junk."""
    shape = (repr(tuple(rng.randint(-3, 2**40) for _ in range(rng.randint(0, 3)))) if rng.random() < 0.5
             else "".join(rng.choices(_NASTY, k=rng.randint(0, 12))))
    return f"{{'descr': {rng.choice(_DESCRS)}, 'fortran_order': {rng.choice(_FLAGS)}, 'shape': {shape}, }}"


_DESCRS = ["'<f4'", "'<f8'", "'<u4'", "'|u1'", "'|O'", "'<c8'", "[('a', '<f4')]", "'V4'", "'<U2'", "'x'", "4", "None"]
_FLAGS = ["False", "True", "0", "'no'"]
_HEADERS = {"mangled": mangled, "fields": fields,
            "junk": lambda rng: "".join(rng.choices(_NASTY, k=rng.randint(0, 80)))}


def payload(kind: str, seed: int, body: bytes) -> bytes:
    """A ``.npy`` payload whose header ``kind`` builds from ``seed`` (cheap to draw: three values per example)."""
    rng = random.Random(seed)
    return npy_payload(_HEADERS[kind](rng), body, rng.choice([1, 2]))


_payloads = st.one_of(
    st.binary(max_size=200),  # anything at all
    st.binary(max_size=120).map(lambda tail: b"\x93NUMPY\x01\x00" + tail),  # the magic, then anything
    st.builds(payload, st.sampled_from(sorted(_HEADERS)), st.integers(0, 2**32 - 1), st.binary(max_size=4 * SIZE + 8)),
)


@settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_payloads)
def test_every_path_rejects_any_bytes_with_a_reason(data: bytes) -> None:
    # each example goes through the plain, the Flower-layout and the secure-aggregation decoder
    for parse, error in PATHS.values():
        try:
            parse(data)
        except error as exc:
            assert str(exc) and "\n" not in str(exc)


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(list(Stage)), st.binary(max_size=120))
def test_secagg_stage_payloads_reject_any_bytes(stage: Stage, payload: bytes) -> None:
    try:
        read_reply(stage, 1, masked_reply(b"", payload, stage))
    except SecAggProtocolError as exc:
        assert str(exc)


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(st.sampled_from(["num-examples", "eval-loss", "eval-accuracy", "eval_loss", "eval_acc",
                                         "train-loss", "train-examples", "eval-x"]),
                       st.one_of(st.floats(), st.integers(-(2**62), 2**62)), max_size=5))
def test_eval_path_rejects_anything_with_a_reason(metrics: dict) -> None:
    try:
        parse_eval_reply(RecordDict({"metrics": MetricRecord(metrics)}))
    except UpdateRejected as exc:
        assert str(exc)


def test_npy_view_reports_the_token_error_in_its_reason() -> None:
    with pytest.raises(UpdateRejected, match=r"update is not a valid \.npy buffer: TokenError"):
        npy_view(npy_payload(TOKEN_ERROR_HEADER, bytes(4 * SIZE)))
