"""bench.llm writes its CUDA rows to the json as each one finishes."""

import json

from bench.llm import Rows


def test_rows_written_as_each_finishes(tmp_path):
    path = tmp_path / "llm.json"
    rows = Rows(str(path))
    row = {"row": "kiln", "decode_b1_tok_s": 1.0}
    rows.emit(row)
    assert json.loads(path.read_text()) == [row]
    row["throughput_256_tok_s"] = 2.0  # a row completed later is rewritten, not repeated
    rows.emit(row)
    rows.emit({"row": "transformers eager"})
    got = json.loads(path.read_text())
    assert [r["row"] for r in got] == ["kiln", "transformers eager"]
    assert got[0]["throughput_256_tok_s"] == 2.0
