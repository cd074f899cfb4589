"""REPRODUCTION.md is rendered only from the JSONs present; verdicts follow the numbers."""

from __future__ import annotations

import json

from confkv.eval.reproduction import main


def _row(ppl: float, peak: int, spec: str) -> dict:
    return {
        "ppl": ppl,
        "peak_kv_bytes": peak,
        "mean_kv_bytes": peak / 2,
        "seconds": 1.0,
        "resolved_policy": spec,
    }


def test_renders_partial_ppl_and_marks_missing_claims(tmp_path):
    results = {
        "full": _row(30.0, 30 * 2**20, "full"),
        "window:n=512": _row(39.0, 10 * 2**20, "window"),
        "confkv:int8=1": _row(30.2, 10 * 2**20, "confkv:int8=1,n_high=1617"),
    }
    body = {"model": "m", "tokens": 769, "partial_of": 4096, "results": results}
    (tmp_path / "ppl_persuasion_4096.partial.json").write_text(json.dumps(body))
    assert main(["--reports", str(tmp_path)]) == 0
    text = (tmp_path / "REPRODUCTION.md").read_text()
    assert "769 of 4096 tokens" in text
    assert "pending, so far: within 1%: met; strictly best: met" in text
    assert "3.00x" in text and "pending (not at 4K yet), so far: met" in text
    assert "| 2 |" not in text  # no ablation JSON: no invented row


def test_final_json_wins_over_partial(tmp_path):
    results = {"full": _row(30.0, 90, "full"), "confkv:int8=1": _row(31.0, 30, "confkv:int8=1")}
    (tmp_path / "ppl_persuasion_4096.partial.json").write_text(
        json.dumps({"tokens": 100, "results": results})
    )
    (tmp_path / "ppl_persuasion_4096.json").write_text(json.dumps({"tokens": 4096, "results": results}))
    main(["--reports", str(tmp_path)])
    text = (tmp_path / "REPRODUCTION.md").read_text()
    assert "(4096 tokens)" in text and "within 1%: missed" in text
