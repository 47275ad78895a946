"""The recorder's files are JSON that any reader accepts: NaN and infinities are written as null
(a metrics row's `reward` is NaN when no episode finished since the last step)."""

from __future__ import annotations

import json
import math

from astranb.session.recorder import Recorder


def strict_loads(line: str):
    def refuse(constant):
        raise ValueError(f"{constant} is not JSON")

    return json.loads(line, parse_constant=refuse)


def test_nan_and_infinity_are_written_as_null(tmp_path):
    recorder = Recorder(tmp_path, {})
    recorder.add_row({"step": 0, "reward": float("nan"), "loss": float("inf"),
                      "nested": {"x": [1.5, float("-inf")]}})
    recorder.add_event("rollback", {"grad_norm": float("nan")})
    recorder.close()
    (row,) = [strict_loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert row == {"step": 0, "reward": None, "loss": None, "nested": {"x": [1.5, None]}}
    (event,) = [strict_loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert event == {"kind": "rollback", "grad_norm": None}
    # in memory the row keeps its float NaN (pandas reads it as a missing value)
    assert math.isnan(recorder.rows[0]["reward"])
