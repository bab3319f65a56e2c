"""`cagflow bench plot`: the points it reads from saved dataset results, the image, and clear errors."""

from __future__ import annotations

import json

from cagflow.bench.plot import points
from cagflow.cli import main


def _record(prompt: int, ttft: float | None) -> dict:
    return {"answered": True, "ttft_s": ttft, "tokens": {"prompt": prompt, "reused": prompt - 20, "generated": 5}}


REPORT = {"rows": [
    {"id": "a", "cache": _record(2500, 0.6), "retrieval": _record(700, 0.5)},
    {"id": "b", "auto": _record(2400, 0.7), "retrieval": {"answered": False, "ttft_s": None, "tokens": {}}},
]}


def test_points_take_every_route_that_reached_the_model():
    assert sorted(points(REPORT)) == [("auto", 2400, 0.7), ("cache", 2500, 0.6), ("retrieval", 700, 0.5)]


def test_plot_command_writes_an_image_and_refuses_files_without_answers(tmp_path, capsys):
    results = tmp_path / "answers-x.json"
    results.write_text(json.dumps(REPORT))
    image = tmp_path / "ttft.png"
    assert main(["bench", "plot", str(results), "--out", str(image)]) == 0
    assert image.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    empty = tmp_path / "empty.json"
    empty.write_text(json.dumps({"rows": []}))
    assert main(["bench", "plot", str(empty), "--out", str(image)]) == 2
    assert "no answer with a route" in capsys.readouterr().err
