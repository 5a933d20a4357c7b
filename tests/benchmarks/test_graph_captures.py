"""benchmarks.graph_captures runs end to end on a few requests and exits 0 only when outputs equal graphs off."""

import pytest

from benchmarks import graph_captures


@pytest.mark.slow
def test_graph_captures_table(capsys):
    assert graph_captures.main(["--requests", "6"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].startswith("requests | speculative | steps | graphed steps | captures")
    cells = [c.strip() for c in lines[1].split("|")]
    assert cells[0] == "6" and cells[-1] == "True"
    steps, graphed, captures, bound = map(int, cells[2:6])
    assert 0 < captures <= graphed < steps and captures <= bound
