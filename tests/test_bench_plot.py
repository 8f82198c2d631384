"""The bench curves' table and plot from sweep records (no timing: the numbers are made up)."""

import pytest

from m3sdk.bench_plot import COLUMNS, curve_rows, format_table, plot_curves


def _record(conc: int) -> dict:
    return {"max_concurrency": conc, "output_throughput": 10.0 * conc,
            **{k: float(conc + i) for i, k in enumerate(COLUMNS)}}


def test_rows_sorted_and_tabled():
    rows = curve_rows([_record(4), _record(1), _record(2)])
    assert [r["concurrency"] for r in rows] == [1, 2, 4]
    table = format_table(rows).splitlines()
    assert len(table) == 2 + 3 and table[2].startswith("| 1 | 1.00 | 2.00 |") and table[-1].endswith("| 40.0 |")


def test_rows_need_concurrency_and_p99():
    with pytest.raises(ValueError, match="concurrency"):
        curve_rows([{**_record(1), "max_concurrency": None}])
    with pytest.raises(ValueError, match="99th"):
        curve_rows([{k: v for k, v in _record(1).items() if k != "p99_ttft_ms"}])


def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    path = plot_curves(curve_rows([_record(c) for c in (1, 2, 4, 8)]), tmp_path / "sub" / "curves.png", "t")
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
