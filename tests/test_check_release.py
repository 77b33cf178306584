"""tools/check_release.py's own parts: pytest's summary read, the matrix row written in place."""

from tools import check_release


def test_pytest_summary_is_read():
    out = "....F.s\nFAILED tests/test_a.py::test_b - AssertionError\n= 1 failed, 5 passed, 1 skipped, 2 errors in 3.1s ="
    c = check_release.parse_pytest(out)
    assert (c["passed"], c["failed"], c["skipped"], c["errors"]) == (5, 1, 1, 2)
    assert c["failed_names"] == ["tests/test_a.py::test_b"]
    assert check_release.parse_pytest("= 7 passed in 1.0s =")["errors"] == 0


def test_a_row_replaces_the_row_of_its_release_and_rows_stay_newest_first(tmp_path):
    doc = tmp_path / "torch-versions.md"
    doc.write_text(f"# x\n\n{check_release.MATRIX_START}\n{check_release.HEADER}\n{check_release.MATRIX_END}\n\nafter\n")
    row = "| 2026-12-05 | {} | {} | 1 | 0 | 0 | ok |"
    check_release.write_row(row.format("aaa", "2.13.0"), "2.13.0", doc)
    check_release.write_row(row.format("aaa", "2.15.0"), "2.15.0", doc)
    check_release.write_row(row.format("bbb", "2.13.0"), "2.13.0", doc)
    text = doc.read_text()
    rows = [line for line in text.splitlines() if line.startswith("| 2026")]
    assert rows == [row.format("aaa", "2.15.0"), row.format("bbb", "2.13.0")]
    assert text.startswith("# x\n") and text.endswith(f"{check_release.MATRIX_END}\n\nafter\n")
