"""core.logs: after ``setup_logging`` every record is one JSON object per line on stderr with the time, level,
service, logger and message, the ``extra`` fields, and the traceback of an exception; the level comes from the
argument or ``EMBEDMESH_LOG_LEVEL``."""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterator

import pytest

from embedmesh.core.logs import get_logger, setup_logging


@pytest.fixture
def restore_root() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


def _lines(err: str) -> list[dict]:
    return [json.loads(line) for line in err.splitlines() if line.strip()]


def test_records_are_json_lines_with_service_and_extra_fields(restore_root: None,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    setup_logging("router", level="debug")
    log = get_logger("embedmesh.test.logs")
    log.info("worker %s joined", "w1", extra={"worker_id": "w1", "blocks": 3})
    log.debug("details")
    out = _lines(capsys.readouterr().err)
    assert len(out) == 2
    first = out[0]
    assert (first["level"], first["service"], first["logger"], first["msg"]) == ("info", "router",
                                                                                  "embedmesh.test.logs",
                                                                                  "worker w1 joined")
    assert first["worker_id"] == "w1" and first["blocks"] == 3
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", first["ts"])
    # LogRecord's own attributes (args, pathname, ...) are not repeated as fields.
    assert not {"args", "pathname", "lineno", "msecs", "exc_info"} & set(first)
    assert out[1]["level"] == "debug"


def test_exceptions_carry_their_traceback(restore_root: None, capsys: pytest.CaptureFixture[str]) -> None:
    setup_logging("worker", level="INFO")
    try:
        raise RuntimeError("engine fell over")
    except RuntimeError:
        get_logger("x").exception("step failed")
    (rec,) = _lines(capsys.readouterr().err)
    assert rec["level"] == "error" and rec["msg"] == "step failed"
    assert "RuntimeError: engine fell over" in rec["exc"] and "Traceback" in rec["exc"]


def test_values_json_cannot_encode_are_written_as_text(restore_root: None,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    setup_logging("gateway", level="INFO")
    get_logger("x").warning("odd", extra={"obj": object()})
    (rec,) = _lines(capsys.readouterr().err)
    assert rec["obj"].startswith("<object object at")


def test_level_comes_from_the_environment_when_not_given(restore_root: None, monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("EMBEDMESH_LOG_LEVEL", "warning")
    setup_logging("cache")
    assert logging.getLogger().level == logging.WARNING
    log = get_logger("x")
    log.info("hidden")
    log.warning("shown")
    assert [r["msg"] for r in _lines(capsys.readouterr().err)] == ["shown"]
    # One handler replaces whatever was there: a second setup does not double every line.
    setup_logging("cache")
    log.warning("once")
    assert [r["msg"] for r in _lines(capsys.readouterr().err)] == ["once"]
